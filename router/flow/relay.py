"""Relay: the workers' chunks passed on to the client as they come, either collected into one
response body (`collect`) or as SSE events (`stream`), prompt after prompt. Each run is counted
(router/flow/accounting.py) as it ends; the HTTP request once, when all have."""

import asyncio

from router.flow.accounting import Accounting, total_usage
from router.flow.request_run import Admitted, RequestRun, Started
from router.http.errors import OpenAIError, worker_failed
from router.http.responses import SSE_DONE, Choice, Prompt, ResponseShape, sse

FINISH_REASONS = {"stop": "stop", "length": "length"}  # a worker's, the client's


class Relay:
    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting

    async def chunks(self, run: RequestRun, leg: Started):
        """Yield (chunk, finish_reason or None) until every choice has finished; a 502 for a
        request the worker ended otherwise (aborted)."""
        finished = 0
        chunk = leg.first
        while True:
            self.accounting.chunk(run, chunk)
            if not chunk.finish_reason:
                yield chunk, None
            elif chunk.finish_reason not in FINISH_REASONS:
                raise worker_failed(f"the worker ended the request: {chunk.finish_reason}")
            else:
                yield chunk, FINISH_REASONS[chunk.finish_reason]
                finished += 1
                if finished == run.choices:
                    return
            try:  # (the first chunk came apart: no generator around both, a hop per token)
                chunk = await anext(leg.chunks)
            except StopAsyncIteration:
                return

    async def collect(
        self, admitted: Admitted, started: list[Started], shape: ResponseShape, endpoint: str
    ) -> dict:
        """The whole response body: every run's choices (the best `n` of each, by cumulative
        logprob, when best_of sampled more), in prompt order."""
        runs = [
            self._collect_run(run, prompt, leg)
            for run, prompt, leg in zip(admitted.runs, admitted.prompts, started, strict=True)
        ]
        try:  # a lone run in the caller's task (a gather makes a task for it)
            choices = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        finally:
            for leg in started:
                await leg.chunks.aclose()
        usages = [self.accounting.finish(run) for run in admitted.runs]
        self.accounting.served(endpoint)
        returned = [best(run_choices, admitted.returned) for run_choices in choices]
        for number, run_choices in enumerate(returned):
            for offset, choice in enumerate(run_choices):
                choice.index = number * admitted.returned + offset
        return shape.whole(admitted.prompts, returned, total_usage(usages))

    async def _collect_run(self, run: RequestRun, prompt: Prompt, leg: Started) -> list[Choice]:
        choices = [Choice(index) for index in range(run.choices)]
        async for chunk, reason in self.chunks(run, leg):
            if chunk.prompt_logprobs:
                prompt.logprobs = list(chunk.prompt_logprobs)
            choices[chunk.index].add(chunk, reason)
        if run.prefill is not None:  # before closing the legs, which cancels the prefill
            await run.prefill.wait()
        return choices

    async def stream(
        self, admitted: Admitted, started: list[Started], shape: ResponseShape, endpoint: str
    ):
        """The SSE events, prompt after prompt (each run started already: its tokens wait in
        its stream meanwhile); a failure after streaming started is an error event."""
        usages = []
        try:
            for number, (run, prompt, leg) in enumerate(
                zip(admitted.runs, admitted.prompts, started, strict=True)
            ):
                async for chunk, reason in self.chunks(run, leg):
                    if chunk.prompt_logprobs:
                        prompt.logprobs = list(chunk.prompt_logprobs)
                    index = number * admitted.returned + chunk.index
                    for event in shape.chunk_events(prompt, index, chunk, reason):
                        yield event
                if run.prefill is not None:  # before closing the legs: that cancels the prefill
                    await run.prefill.wait()
                usages.append(self.accounting.finish(run))
            if admitted.include_usage:
                yield shape.usage_chunk(total_usage(usages))
            self.accounting.served(endpoint)
        except OpenAIError as error:
            self.accounting.error(error, endpoint)
            yield sse(error.body())
        except (asyncio.CancelledError, GeneratorExit):  # the client left (between two events)
            self.accounting.disconnect(endpoint)
            raise
        finally:
            for leg in started:
                await leg.chunks.aclose()
        yield SSE_DONE


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The n choices with the highest cumulative logprob (all of them, in order, when n were
    sampled)."""
    if len(choices) == n:
        return choices
    return sorted(choices, key=lambda choice: choice.cumulative_logprob, reverse=True)[:n]
