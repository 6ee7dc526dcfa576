"""Migration of requests with several choices and of seeded ones (router/flow/migration.py), through
the real request flow and relay over fake workers: the first decode worker streams some chunks
and is lost (UNAVAILABLE), the next one answers each continuation by what it was asked. The
client's view is read from the SSE events or the whole body it would get. No engine, no
network."""

import asyncio
import json
import time

import pytest

from pdserve.protocol import worker_pb2
from router.flow.request_run import Admitted, RequestRun
from router.http.errors import OpenAIError, worker_unavailable
from router.http.responses import CompletionShape, OutputOptions, Prompt
from tests.fakes import FakeWorker, router_over

PROMPT = [11, 12, 13, 14, 15]

LOST = worker_unavailable("worker decode-a is unavailable: Socket closed")


class FakeAnsweringWorker(FakeWorker):
    """A fake decode worker whose chunks depend on the request: `answer(request)` gives them
    (then `error`, if it has one)."""

    def __init__(self, name: str, answer) -> None:
        super().__init__(name)
        self.answer = answer

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float):
        self.requests.append(request)
        self.timeouts.append(timeout)
        for chunk in self.answer(request):
            yield chunk
        if self.error is not None:
            raise self.error


def chunk(index: int, *tokens: int, text: str = "", finish: str = "", logprob=None):
    """A worker chunk of choice `index`; `logprob`: each token's own logprob (then the last
    chunk of a choice carries `cumulative_logprob` = logprob * tokens, the worker's sum)."""
    made = worker_pb2.GenerateChunk(index=index, token_ids=tokens, text=text, finish_reason=finish)
    if logprob is not None:
        for token in tokens:
            entry = worker_pb2.TokenLogprob(token_id=token, logprob=logprob, rank=1)
            made.logprobs.append(worker_pb2.PositionLogprobs(entries=[entry]))
    return made


def two_choices(max_tokens: int = 4, **sampling) -> tuple[RequestRun, Admitted]:
    run = RequestRun("cmpl-1", len(PROMPT), time.monotonic(), choices=2)
    request = worker_pb2.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=PROMPT,
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, n=2, **sampling),
    )
    admitted = Admitted(
        "cmpl-1",
        [run],
        [request],
        [Prompt(list(PROMPT))],
        OutputOptions(),
        stream=True,
        include_usage=True,
    )
    return run, admitted


def streamed(flow, admitted: Admitted) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """What a streaming client gets: text and finish reason per choice index, and the usage
    (an error event raises its OpenAIError's status and message as a ValueError)."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None

    async def go():
        nonlocal usage
        started = await flow.starter.start_all(admitted)
        shape = CompletionShape("cmpl-1", "m")
        async for event in flow.relay.stream(admitted, started, shape, "completions"):
            data = event.removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            body = json.loads(data)
            if "error" in body:
                raise ValueError(body["error"])
            usage = body.get("usage") or usage
            for choice in body["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]

    asyncio.run(go())
    return texts, finishes, usage


def test_each_choice_continues_from_its_own_tokens_with_its_index_and_usage():
    dying = FakeWorker(
        "decode-a",
        chunks=[chunk(0, 1, text="A"), chunk(1, 5, text="X"), chunk(0, 2, text="B")],
        error=LOST,
    )
    answers = {
        (*PROMPT, 1, 2): [chunk(0, 3, text="C"), chunk(0, 4, text="D", finish="length")],
        (*PROMPT, 5): [chunk(0, 6, text="Y"), chunk(0, 7, 8, text="ZW", finish="length")],
    }
    rest = FakeAnsweringWorker("decode-b", lambda r: answers[tuple(r.prompt_token_ids)])
    flow = router_over(dying, rest)
    run, admitted = two_choices()

    texts, finishes, usage = streamed(flow, admitted)
    assert texts == {0: "ABCD", 1: "XYZW"}  # nothing twice, nothing lost, each in its place
    assert finishes == {0: "length", 1: "length"}
    assert usage["completion_tokens"] == 8
    by_choice = {r.request_id: r for r in rest.requests}
    assert sorted(by_choice) == ["cmpl-1-m1-c0", "cmpl-1-m1-c1"]
    assert list(by_choice["cmpl-1-m1-c0"].prompt_token_ids) == PROMPT + [1, 2]
    assert by_choice["cmpl-1-m1-c0"].sampling.max_tokens == 2
    assert list(by_choice["cmpl-1-m1-c1"].prompt_token_ids) == PROMPT + [5]
    assert by_choice["cmpl-1-m1-c1"].sampling.max_tokens == 3
    assert {r.sampling.n for r in rest.requests} == {0}  # one choice each
    assert flow.pool.down == {dying.address}
    assert flow.metrics.registry.get_sample_value("pdserve_migrations_total") == 1.0


def test_a_choice_finished_before_the_loss_does_not_continue():
    dying = FakeWorker(
        "decode-a",
        chunks=[chunk(0, 1, 2, text="AB", finish="stop"), chunk(1, 5, text="X")],
        error=LOST,
    )
    rest = FakeAnsweringWorker("decode-b", lambda r: [chunk(0, 6, text="Y", finish="stop")])
    flow = router_over(dying, rest)
    run, admitted = two_choices()

    texts, finishes, usage = streamed(flow, admitted)
    assert texts == {0: "AB", 1: "XY"}
    assert finishes == {0: "stop", 1: "stop"}
    assert usage["completion_tokens"] == 4
    [continued] = rest.requests
    assert continued.request_id == "cmpl-1-m1-c1"


def test_choices_whose_next_worker_is_lost_too_continue_from_all_they_relayed():
    first = FakeWorker(
        "decode-a", chunks=[chunk(0, 1, text="A"), chunk(1, 5, text="X")], error=LOST
    )
    answers = {
        (*PROMPT, 1, 2): [chunk(0, 3, text="C", finish="length")],
        (*PROMPT, 5): [chunk(0, 6, 7, text="YZ", finish="length")],
    }

    def answer(request):
        """The first move's worker sends choice 0 one more token and is lost as well."""
        if request.request_id.startswith("cmpl-1-m1"):
            if request.prompt_token_ids[-1] == 1:
                yield chunk(0, 2, text="B")
            raise LOST
        yield from answers[tuple(request.prompt_token_ids)]

    second, third = FakeAnsweringWorker("decode-b", answer), FakeAnsweringWorker("decode-c", answer)
    flow = router_over(first, second, third)
    run, admitted = two_choices(max_tokens=3)

    texts, _, usage = streamed(flow, admitted)
    assert texts == {0: "ABC", 1: "XYZ"}
    assert usage["completion_tokens"] == 6
    assert run.migrations == 2
    last = [r.request_id for r in second.requests + third.requests if "-m2-" in r.request_id]
    assert sorted(last) == ["cmpl-1-m2-c0", "cmpl-1-m2-c1"]
    assert len(flow.pool.down) == 2


def test_best_of_ranks_a_migrated_choice_by_every_token_it_sampled():
    """Choice 0 sampled an unlikely token before the loss; its continuation alone looks best."""
    dying = FakeWorker(
        "decode-a",
        chunks=[chunk(0, 1, text="A", logprob=-5.0), chunk(1, 5, text="X", logprob=-1.0)],
        error=LOST,
    )

    def answer(request):
        last = request.prompt_token_ids[-1]
        final = chunk(0, last + 1, text="?", finish="length", logprob=-0.1 if last == 1 else -0.5)
        final.cumulative_logprob = final.logprobs[0].entries[0].logprob  # the worker's sum
        return [final]

    flow = router_over(dying, FakeAnsweringWorker("decode-b", answer))
    run, admitted = two_choices(max_tokens=2, logprobs=0)
    admitted.returned, admitted.stream = 1, False

    async def go():
        started = await flow.starter.start_all(admitted)
        return await flow.relay.collect(admitted, started, CompletionShape("c", "m"), "completions")

    [best] = asyncio.run(go())["choices"]
    assert best["text"] == "X?"  # -1.5 in all, against choice 0's -5.1


def replaying_worker(answers: dict[int, list]) -> FakeAnsweringWorker:
    """A fake next worker that answers a replay by the seed it was asked to sample with."""
    return FakeAnsweringWorker("decode-b", lambda r: answers[r.sampling.seed])


def test_a_seeded_choice_is_replayed_with_its_own_seed_and_goes_on_after_what_was_sent():
    dying = FakeWorker(
        "decode-a",
        chunks=[chunk(0, 1, text="a"), chunk(1, 5, text="x"), chunk(0, 2, text="b")],
        error=LOST,
    )
    rest = replaying_worker(
        {
            7: [chunk(0, 1, text="a"), chunk(0, 2, 3, text="bc", finish="length")],
            8: [chunk(0, 5, 6, text="xy"), chunk(0, 7, text="z", finish="length")],
        }
    )
    flow = router_over(dying, rest)
    run, admitted = two_choices(max_tokens=3, seed=7, temperature=0.8)

    texts, finishes, usage = streamed(flow, admitted)
    assert texts == {0: "abc", 1: "xyz"}  # the seeded sequences, none of the replay twice
    assert finishes == {0: "length", 1: "length"}
    assert usage["completion_tokens"] == 6  # the replayed tokens are not counted again
    for replay in rest.requests:  # from the prompt, the whole request, choice i's seed
        assert list(replay.prompt_token_ids) == PROMPT
        assert replay.sampling.max_tokens == 3
    assert sorted(r.sampling.seed for r in rest.requests) == [7, 8]


def test_a_seeded_replay_that_parts_from_what_was_sent_ends_in_a_502_not_other_tokens():
    dying = FakeWorker("decode-a", chunks=[chunk(0, 1, 2, text="ab")], error=LOST)
    rest = replaying_worker({7: [chunk(0, 1, 9, text="az", finish="length")]})
    flow = router_over(dying, rest)
    run = RequestRun("cmpl-1", len(PROMPT), time.monotonic())
    request = worker_pb2.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=PROMPT,
        sampling=worker_pb2.SamplingParams(max_tokens=3, seed=7, temperature=1.0),
    )

    async def go():
        started = await flow.starter.start(run, request)
        return [c async for c in started.chunks]

    with pytest.raises(OpenAIError) as caught:
        asyncio.run(go())
    assert (caught.value.status, caught.value.kind) == (502, "worker_error")
    assert "after 1 of 2" in caught.value.message


def test_a_greedy_request_with_a_seed_continues_from_its_tokens():
    """At temperature 0 the seed draws nothing: there is no random stream to replay."""
    dying = FakeWorker("decode-a", chunks=[chunk(0, 1, text="a")], error=LOST)
    rest = FakeWorker("decode-b", chunks=[chunk(0, 2, text="b", finish="length")])
    flow = router_over(dying, rest)
    run = RequestRun("cmpl-1", len(PROMPT), time.monotonic())
    request = worker_pb2.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=PROMPT,
        sampling=worker_pb2.SamplingParams(max_tokens=2, seed=7, temperature=0.0),
    )

    async def go():
        started = await flow.starter.start(run, request)
        return [c async for c in started.chunks]

    assert [list(c.token_ids) for c in asyncio.run(go())] == [[2]]
    [continued] = rest.requests
    assert list(continued.prompt_token_ids) == PROMPT + [1]
