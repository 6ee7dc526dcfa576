"""One request through the router, step by step:

    admit   validate the body, tokenize, build the worker request, choose the path
    start   send it on its path (prefill leg + decode leg, or local) and wait for the first
            chunk; a decode worker found unavailable first is marked down and another one tried
    relay   pass the chunks on as they come (`collect` for a whole response, `stream` for SSE);
            a decode worker lost mid-stream is marked down and the request migrates: another
            decode worker continues it from the prompt plus the tokens already relayed
    finish  count the request in the metrics and return its usage

The HTTP layer (router/app.py) only calls these steps; they know nothing of FastAPI, so they can
be driven with fake workers. Every failure is an OpenAIError with its status code.
"""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from pdserve.settings import json_logs
from pdserve.settings.router import WITH_PREFILL, RouterSettings
from pdserve.worker.protocol import worker_pb2
from router.disaggregation import PrefillOutcome, generate_disaggregated
from router.errors import (
    OpenAIError,
    check_model,
    context_length_exceeded,
    invalid_request,
    request_timeout,
    worker_unavailable,
)
from router.metrics import RouterMetrics
from router.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_request,
)
from router.responses import SSE_DONE, Choice, OutputOptions, Prompt, ResponseShape, Usage, sse
from router.route_choice import (
    DISAGGREGATED,
    LENGTH,
    LOCAL,
    ROUTE_HEADER,
    STAY_ON_PREFILL,
    RouteDecision,
    WorkerState,
    by_length,
    cluster_costs,
    estimate,
    forced_route,
)
from router.worker_client import WorkerClient
from router.worker_pool import WorkerPool

log = logging.getLogger("pdserve.router")
FINISH_REASONS = {"stop": "stop", "length": "length"}
TAKES_REQUESTS = ("decode", "colocated")
MAX_ATTEMPTS = 3  # decode workers a request may try when they turn out unavailable
MAX_MIGRATIONS = 2  # times a request may move on after its decode worker was lost mid-stream


@dataclass
class RequestRun:
    """One request's state while it is relayed; times are router monotonic seconds."""

    request_id: str
    prompt_tokens: int
    arrival: float
    timeout_s: float = 600.0  # the request's one deadline is arrival + timeout_s, for every leg
    route: str = LOCAL
    # A path fixed before any estimate, and why: the client's x-pdserve-route ("header"), or
    # local once every prefill worker was lost ("prefill_lost").
    route_forced: RouteDecision | None = None
    decision: RouteDecision | None = None  # why the run took its path
    prefill: PrefillOutcome | None = None  # the prefill leg, when disaggregated
    decode_worker: WorkerClient | None = None
    first_token_at: float | None = None
    second_token_at: float | None = None  # disaggregated: the decode worker's first, usually
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_chunk: worker_pb2.GenerateChunk | None = None
    token_ids: list[int] = field(default_factory=list)  # relayed so far (one choice only)
    migrations: int = 0
    choices: int = 1  # sampled from the prompt (n, or best_of)

    def time_left(self) -> float:
        """Seconds until the request's deadline; a 504 once it has passed."""
        left = self.arrival + self.timeout_s - time.monotonic()
        if left <= 0:
            raise request_timeout(self.timeout_s)
        return left


@dataclass
class Admitted:
    """A request that passed validation, ready to start: one run per prompt (a batch on
    /v1/completions has several), each with its worker request."""

    request_id: str
    runs: list[RequestRun]
    worker_requests: list[worker_pb2.GenerateRequest]
    prompts: list[Prompt]
    options: OutputOptions
    stream: bool
    include_usage: bool
    returned: int = 1  # choices returned per prompt (n): the best of `run.choices`


@dataclass
class Started:
    """A run on its way: its first chunk, the rest, and the response headers."""

    first: worker_pb2.GenerateChunk
    chunks: object  # async iterator of the rest
    headers: dict


class RequestFlow:
    def __init__(
        self, settings: RouterSettings, pool: WorkerPool, tokenizer, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.tokenizer = tokenizer  # .chat(parsed) / .completion(parsed) -> prompt token ids
        self.metrics = metrics

    # admit -------------------------------------------------------------------------------

    def admit(
        self,
        endpoint: str,
        schema: type[SamplingFields],
        body,
        id_prefix: str,
        route_header: str | None,
        arrival: float,
        timeout_header: str | None = None,
    ) -> Admitted:
        """`timeout_header`: the client's own limit in seconds (x-pdserve-timeout), used when
        it is below --request-timeout."""
        timeout_s = self.settings.request_timeout_s
        if timeout_header is not None:
            timeout_s = min(timeout_s, parse_timeout(timeout_header))
        parsed = parse_request(schema, body)
        check_model(parsed.model, self.settings.served_model)
        if isinstance(parsed, ChatCompletionRequest):
            prompts = [self.tokenizer.chat(parsed)]
            echo_texts = [chat_echo_text(parsed)]
        else:
            prompts = self.tokenizer.completion_prompts(parsed)
            echo_texts = [
                prompt if isinstance(prompt, str) else self.tokenizer.detokenize(prompt_ids)
                for prompt, prompt_ids in zip(parsed.prompts(), prompts, strict=True)
            ]
        if not self.pool.max_model_len:
            raise worker_unavailable("no worker has joined the pools yet; retry later")
        request_id = f"{id_prefix}-{parsed.request_id or uuid.uuid4().hex}"
        # The workers' ids stay unique when clients reuse their request_id.
        json_logs.request_id.set(request_id)  # on every line logged for this request
        unique = request_id if parsed.request_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
        runs, worker_requests = [], []
        for number, prompt_ids in enumerate(prompts):
            run_id = unique if len(prompts) == 1 else f"{unique}-{number}"
            run = RequestRun(run_id, len(prompt_ids), arrival, timeout_s)
            run.choices = parsed.choice_count()
            worker_requests.append(
                worker_pb2.GenerateRequest(
                    request_id=run.request_id,
                    prompt_token_ids=prompt_ids,
                    sampling=sampling_params(
                        parsed,
                        len(prompt_ids),
                        self.pool.max_model_len,
                        self.settings.default_max_tokens,
                        param="messages" if endpoint == "chat" else "prompt",
                    ),
                )
            )
            forced = forced_route(route_header, bool(self.pool.live(("prefill",))))
            run.route_forced = RouteDecision(forced, "header") if forced else None
            runs.append(run)
        return Admitted(
            request_id,
            runs,
            worker_requests,
            [Prompt(ids, text) for ids, text in zip(prompts, echo_texts, strict=True)],
            output_options(parsed),
            parsed.stream,
            parsed.include_usage_in_stream(),
            returned=parsed.n,
        )

    async def start_all(self, admitted: Admitted) -> list[Started]:
        """Start every run at once; if one fails, the others are closed (which aborts them on
        their workers) and its error raised."""
        results = await asyncio.gather(
            *(
                self.start(run, request)
                for run, request in zip(admitted.runs, admitted.worker_requests, strict=True)
            ),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for result in results:
                if not isinstance(result, BaseException):
                    await result[1].aclose()
            raise failed[0]
        return [Started(*result) for result in results]

    # start -------------------------------------------------------------------------------

    async def start(self, run: RequestRun, worker_request: worker_pb2.GenerateRequest):
        """Send the request on its path and wait for its first chunk; returns (first chunk,
        the rest, response headers). A decode worker found unavailable before any token (it
        died, or left the pools a moment ago) is marked down and the request goes to another
        one, up to MAX_ATTEMPTS workers. A prefill worker lost before the prompt's KV was
        complete is marked down too, and the prompt goes to another prefill worker, or, with
        none left, the local path (counted in pdserve_prefill_lost_total). Only workers whose
        KV is compatible are paired."""
        tried: set[str] = set()
        tried_prefill: set[str] = set()
        while True:
            prompt = worker_request.prompt_token_ids
            worker = run.decode_worker = self.pool.pick(
                TAKES_REQUESTS, frozenset(tried), prompt=prompt
            )
            prefill = self._choose_path(run, worker, tried_prefill, worker_request)
            if run.route == STAY_ON_PREFILL:  # the prefill worker takes the whole request
                worker, prefill = prefill, None
                run.decode_worker = worker
            self.pool.computes(worker, prompt)  # it computes the prompt, or receives its KV
            if prefill is not None:
                self.pool.computes(prefill, prompt)
            headers = {
                "x-request-id": run.request_id,
                "x-pdserve-worker": worker.worker_id,
                ROUTE_HEADER: run.route,
            }
            if prefill is not None:
                run.prefill = PrefillOutcome(admission=self.settings.decode_admission)
                chunks = generate_disaggregated(
                    prefill,
                    worker,
                    worker_request,
                    self.settings.kv_timeout_s,
                    run.time_left(),
                    run.prefill,
                    attempt=len(tried_prefill),
                )
                headers["x-pdserve-prefill-worker"] = prefill.worker_id
            else:
                run.prefill = None
                chunks = worker.generate(worker_request, timeout=run.time_left())
            try:
                first = await anext(chunks)
            except OpenAIError as error:
                if error.kind == "prefill_unavailable":
                    self._prefill_lost(run, prefill, tried_prefill, error)
                    continue
                if error.kind != "worker_unavailable":
                    raise
                self.pool.mark_down(worker)
                tried.add(worker.address)
                if len(tried) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: %s; trying another worker", run.request_id, error.message)
                continue
            if run.prefill is not None and run.prefill.error_kind == "worker_unavailable":
                self.pool.mark_down(prefill)
            self.metrics.routes.labels(run.route).inc()
            return first, self._migrating(run, worker_request, chunks), headers

    def _choose_path(
        self,
        run: RequestRun,
        decode: WorkerClient,
        tried_prefill: set[str],
        request: worker_pb2.GenerateRequest,
    ) -> WorkerClient | None:
        """Decide the run's path (router/route_choice.py) given its decode worker; returns the
        prefill worker when the path uses one. Every decision is counted by path and reason
        and kept in `run.decision` for the timing breakdown."""
        prompt = request.prompt_token_ids
        floor = self.settings.disaggregate_min_tokens
        decision = run.route_forced
        if decision is None and not [
            w for w in self.pool.live(("prefill",)) if w.address not in tried_prefill
        ]:
            decision = RouteDecision(LOCAL, "no_prefill_worker")
        elif decision is None and self.settings.route_policy == LENGTH:
            decision = by_length(len(prompt), floor)
        prefill = None
        if decision is None or decision.route != LOCAL:
            prefill = self._pick_prefill(run, decode, tried_prefill, prompt)
            if prefill is None:
                decision = RouteDecision(LOCAL, "no_prefill_worker")
        if decision is None:
            cluster = cluster_costs(self.pool.live(("prefill", *TAKES_REQUESTS)))
            decision = estimate(
                len(prompt),
                request.sampling.max_tokens * max(1, request.sampling.n),
                WorkerState.of(decode, cluster, self.pool.cached_tokens(decode, prompt)),
                WorkerState.of(prefill, cluster, self.pool.cached_tokens(prefill, prompt)),
                floor,
                decode_full=decode.load.full(decode.max_num_seqs),
            )
        run.decision = decision
        run.route = decision.route
        self.metrics.route_decisions.labels(decision.route, decision.reason).inc()
        return prefill if decision.route != LOCAL else None

    def _pick_prefill(
        self, run: RequestRun, decode: WorkerClient, tried: set[str], prompt
    ) -> WorkerClient | None:
        """A prefill worker whose KV `decode` can take; with none (all gone since admission, or
        all incompatible with it: a misconfigured pool) the request takes the local path,
        counted in pdserve_kv_fallbacks_total{policy="no_prefill"} and logged with why."""
        try:
            return self.pool.pick(("prefill",), frozenset(tried), pairs_with=decode, prompt=prompt)
        except OpenAIError as error:
            log.warning("request %s: %s; local path", run.request_id, error.message)
            self.metrics.kv_fallbacks.labels("no_prefill").inc()
            return None

    def _prefill_lost(
        self, run: RequestRun, prefill: WorkerClient, tried: set[str], error: OpenAIError
    ) -> None:
        """Mark the lost prefill worker down; the next attempt goes to another one, or takes
        the local path when none is left or MAX_ATTEMPTS were tried."""
        self.pool.mark_down(prefill)
        tried.add(prefill.address)
        others = [w for w in self.pool.live(("prefill",)) if w.address not in tried]
        if others and len(tried) < MAX_ATTEMPTS:
            self.metrics.prefill_lost.labels("another_prefill").inc()
            log.warning(
                "request %s: %s; trying another prefill worker", run.request_id, error.message
            )
            return
        log.warning(
            "request %s: %s; no prefill worker left: local path", run.request_id, error.message
        )
        run.route_forced = RouteDecision(LOCAL, "prefill_lost")
        self.metrics.prefill_lost.labels("local").inc()

    async def _migrating(self, run: RequestRun, request: worker_pb2.GenerateRequest, chunks):
        """The request's chunks; when its decode worker is lost mid-stream, the rest come from
        another one, which continues from the prompt plus the tokens relayed so far (computed
        there as prompt: greedy output is what an undisturbed run gives), with max_tokens
        reduced by as many. The client sees one stream, no token twice or missing."""
        current = chunks
        lost_at = None
        try:
            while True:
                try:
                    async for chunk in current:
                        if lost_at is not None:
                            gap = time.monotonic() - lost_at
                            self.metrics.migration_gap.observe(gap)
                            log.info("request %s resumed %.3f s later", run.request_id, gap)
                            lost_at = None
                        yield chunk
                    return
                except OpenAIError as error:
                    if (
                        error.kind != "worker_unavailable"
                        or run.migrations >= MAX_MIGRATIONS
                        or run.choices > 1  # n choices do not migrate (yet)
                    ):
                        raise
                    lost_at = time.monotonic()
                    self.pool.mark_down(run.decode_worker)
                    await current.aclose()
                    current = self._continuation(run, request)
                    log.warning(
                        "request %s: %s after %d tokens; continuing on %s",
                        run.request_id,
                        error.message,
                        len(run.token_ids),
                        run.decode_worker.worker_id,
                    )
        finally:
            await current.aclose()

    def _continuation(self, run: RequestRun, request: worker_pb2.GenerateRequest):
        """The rest of the request on another decode worker (local path: it computes the prompt
        and the relayed tokens itself), within the request's remaining time."""
        run.migrations += 1
        self.metrics.migrations.inc()
        worker = run.decode_worker = self.pool.pick(TAKES_REQUESTS)
        rest = worker_pb2.GenerateRequest()
        rest.CopyFrom(request)
        rest.ClearField("kv")
        rest.sampling.ClearField("prompt_logprobs")  # the client has them already
        rest.request_id = f"{run.request_id}-m{run.migrations}"
        rest.prompt_token_ids.extend(run.token_ids)
        rest.sampling.max_tokens -= len(run.token_ids)
        rest.sampling.min_tokens = max(0, rest.sampling.min_tokens - len(run.token_ids))
        return worker.generate(rest, timeout=run.time_left())

    # relay -------------------------------------------------------------------------------

    async def relay(self, run: RequestRun, first, chunks):
        """Yield (chunk, finish_reason or None) until every choice has finished."""
        finished = 0
        async for chunk in _prepend(first, chunks):
            self._on_chunk(run, chunk)
            if not chunk.finish_reason:
                yield chunk, None
                continue
            if chunk.finish_reason not in FINISH_REASONS:
                raise OpenAIError(
                    502,
                    f"the worker ended the request: {chunk.finish_reason}",
                    "worker_error",
                    type="server_error",
                    code="worker_error",
                )
            yield chunk, FINISH_REASONS[chunk.finish_reason]
            finished += 1
            if finished == run.choices:
                return

    async def collect(
        self, admitted: Admitted, started: list[Started], shape: ResponseShape, endpoint: str
    ) -> dict:
        """The whole response body: every run's choices (the best `n` of each, by cumulative
        logprob, when best_of sampled more), in prompt order."""
        try:
            choices = await asyncio.gather(
                *(
                    self._collect_run(run, prompt, leg)
                    for run, prompt, leg in zip(
                        admitted.runs, admitted.prompts, started, strict=True
                    )
                )
            )
        finally:
            for leg in started:
                await leg.chunks.aclose()
        usages = [self.finish(run, endpoint) for run in admitted.runs]
        returned = [best(run_choices, admitted.returned) for run_choices in choices]
        for number, run_choices in enumerate(returned):
            for offset, choice in enumerate(run_choices):
                choice.index = number * admitted.returned + offset
        return shape.whole(admitted.prompts, returned, total_usage(usages))

    async def _collect_run(self, run: RequestRun, prompt: Prompt, leg: Started) -> list[Choice]:
        choices = [Choice(index) for index in range(run.choices)]
        async for chunk, reason in self.relay(run, leg.first, leg.chunks):
            if chunk.prompt_logprobs:
                prompt.logprobs = list(chunk.prompt_logprobs)
            choices[chunk.index].add(chunk, reason)
        if run.prefill is not None:  # before closing the legs, which cancels the prefill
            await run.prefill.wait()
        return choices

    async def stream(
        self,
        admitted: Admitted,
        started: list[Started],
        shape: ResponseShape,
        endpoint: str,
    ):
        """The SSE events, prompt after prompt (each run started already: its tokens wait in
        its stream meanwhile); a failure after streaming started is an error event."""
        usages = []
        try:
            for number, (run, prompt, leg) in enumerate(
                zip(admitted.runs, admitted.prompts, started, strict=True)
            ):
                async for chunk, reason in self.relay(run, leg.first, leg.chunks):
                    if chunk.prompt_logprobs:
                        prompt.logprobs = list(chunk.prompt_logprobs)
                    index = number * admitted.returned + chunk.index
                    for event in shape.chunk_events(prompt, index, chunk, reason):
                        yield event
                if run.prefill is not None:  # before closing the legs: that cancels the prefill
                    await run.prefill.wait()
                usages.append(self.finish(run, endpoint))
            if admitted.include_usage:
                yield shape.usage_chunk(total_usage(usages))
        except OpenAIError as error:
            self.count_error(error, endpoint)
            yield sse(error.body())
        except asyncio.CancelledError:
            self.count_disconnect(endpoint)
            raise
        finally:
            for leg in started:
                await leg.chunks.aclose()
        yield SSE_DONE

    def _on_chunk(self, run: RequestRun, chunk: worker_pb2.GenerateChunk) -> None:
        if not chunk.token_ids:
            return
        now = time.monotonic()
        if run.last_token_at is None:
            run.first_token_at = now
            self.metrics.ttft.observe(now - run.arrival)
        else:
            self.metrics.inter_token.observe(now - run.last_token_at)
            run.second_token_at = run.second_token_at or now
        run.last_token_at = now
        run.completion_tokens += len(chunk.token_ids)
        if run.choices == 1:
            run.token_ids.extend(chunk.token_ids)
        if not run.migrations and chunk.index == 0:  # the first worker's, first choice's
            run.cached_tokens = chunk.cached_tokens
            run.last_chunk = chunk

    # finish ------------------------------------------------------------------------------

    def finish(self, run: RequestRun, endpoint: str) -> Usage:
        metrics = self.metrics
        metrics.e2e.observe(time.monotonic() - run.arrival)
        metrics.prompt_tokens.inc(run.prompt_tokens)
        metrics.generation_tokens.inc(run.completion_tokens)
        metrics.requests.labels(endpoint, "200").inc()
        cached = run.cached_tokens
        if run.route == DISAGGREGATED:
            cached = self._account_transfer(run)
        log.info("timing %s", json.dumps(timing_breakdown(run)))
        return Usage(run.prompt_tokens, run.completion_tokens, cached)

    def _account_transfer(self, run: RequestRun) -> int:
        """KV metrics of a disaggregated request; returns its prompt-cache hit, which happened
        on the prefill worker (the decode worker's count includes the transferred KV)."""
        metrics = self.metrics
        prefill = run.prefill.chunk
        cached_on_prefill = prefill.cached_tokens if prefill is not None else 0
        if run.prefill.ended_request:
            return cached_on_prefill
        decode = run.last_chunk
        transport = run.prefill.transport
        if decode is not None and decode.HasField("kv"):
            transport = decode.kv.transport or transport  # what actually carried it
            metrics.kv_bytes.labels(transport).observe(decode.kv.bytes)
            metrics.kv_seconds.labels(transport).observe(decode.kv.seconds)
            if decode.kv.failed:
                metrics.kv_failures.labels(decode.kv.failure or "timeout").inc()
        failed = run.prefill.error is not None or (decode is not None and decode.kv.failed)
        metrics.kv_transfers.labels(transport, "failed" if failed else "loaded").inc()
        if run.prefill.error is not None:
            metrics.kv_failures.labels("prefill_failed").inc()
        if run.cached_tokens < run.prompt_tokens:  # the decode worker prefilled after all
            metrics.kv_fallbacks.labels("recompute").inc()
            log.warning(
                "request %s fell back to local prefill on %s",
                run.request_id,
                run.decode_worker.worker_id,
            )
        return cached_on_prefill

    def count_error(self, error: OpenAIError, endpoint: str) -> None:
        self.metrics.errors.labels(error.kind).inc()
        self.metrics.requests.labels(endpoint, str(error.status)).inc()
        if error.status >= 500:
            log.warning("%s: %s", error.kind, error.message)

    def count_disconnect(self, endpoint: str) -> None:
        self.metrics.errors.labels("client_disconnect").inc()
        self.metrics.requests.labels(endpoint, "499").inc()


TIMEOUT_HEADER = "x-pdserve-timeout"


def parse_timeout(header: str) -> float:
    try:
        seconds = float(header)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise invalid_request(
            f"{TIMEOUT_HEADER} must be a number of seconds > 0, not {header!r}",
            param=TIMEOUT_HEADER,
        )
    return seconds


async def _prepend(first, chunks):
    yield first
    async for chunk in chunks:
        yield chunk


def timing_breakdown(run: RequestRun) -> dict:
    """Where the time to first token went, from both workers' engine timestamps (seconds)."""
    breakdown = {
        "request_id": run.request_id,
        "route": run.route,
        "decision": run.decision.view() if run.decision is not None else None,
        "ttft": run.first_token_at - run.arrival if run.first_token_at else None,
        # The hand-off: on the disaggregated path the first token is the prefill worker's and
        # the second the decode worker's.
        "first_to_second_token": (
            run.second_token_at - run.first_token_at if run.second_token_at else None
        ),
    }
    decode = run.last_chunk.timing if run.last_chunk is not None else None
    if run.route in (LOCAL, STAY_ON_PREFILL) and decode is not None:
        breakdown.update(queue=decode.queued_seconds, prefill=decode.prefill_seconds)
    elif run.prefill is not None and run.prefill.chunk is not None and decode is not None:
        prefill = run.prefill.chunk.timing
        # The decode leg waits for the KV from its admission on; what it waits after the
        # prefill ended is the transfer time the prefill's compute did not hide.
        waited_during_prefill = (
            prefill.queued_seconds + prefill.prefill_seconds
            if run.prefill.admission == WITH_PREFILL
            else 0.0
        )
        breakdown.update(
            queue=prefill.queued_seconds,
            prefill=prefill.prefill_seconds,
            transfer_wait=decode.queued_seconds,
            exposed_transfer=max(0.0, decode.queued_seconds - waited_during_prefill),
            first_decode_step=decode.prefill_seconds,
        )
    if run.last_chunk is not None and run.last_chunk.HasField("kv"):
        kv = run.last_chunk.kv
        breakdown.update(kv_transport=kv.transport, kv_bytes=kv.bytes, kv_seconds=kv.seconds)
    return breakdown


def sampling_params(
    parsed: SamplingFields,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
    param: str,
) -> worker_pb2.SamplingParams:
    asked = parsed.max_tokens_asked()
    if asked == 0:  # echo alone (completions): one token computed, none returned
        asked = 1
    room = max_model_len - prompt_tokens
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room or room < 1:
        raise context_length_exceeded(prompt_tokens, max(max_tokens, 1), max_model_len, param)
    sampling = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        top_k=parsed.top_k,
        stop=parsed.stop_list(),
        presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty,
        ignore_eos=parsed.ignore_eos,
        min_tokens=parsed.min_tokens or 0,
        vllm_fields_json=json.dumps(parsed.vllm_fields()) if parsed.vllm_fields() else "",
    )
    if sampling.min_tokens > max_tokens:
        raise invalid_request(
            f"min_tokens ({sampling.min_tokens}) must be at most max_tokens ({max_tokens})",
            param="min_tokens",
            code="invalid_value",
        )
    if parsed.seed is not None:
        sampling.seed = parsed.seed
    if parsed.choice_count() > 1:
        sampling.n = parsed.choice_count()
    logprobs = parsed.output_logprobs()
    if logprobs is None and parsed.choice_count() > parsed.n:
        logprobs = 0  # best_of ranks choices by their cumulative logprob
    if logprobs is not None:
        sampling.logprobs = logprobs
    if (prompt_logprobs := parsed.prompt_logprobs_asked()) is not None:
        sampling.prompt_logprobs = prompt_logprobs
    return sampling


def output_options(parsed: SamplingFields) -> OutputOptions:
    echo_only = isinstance(parsed, CompletionRequest) and parsed.echo and parsed.max_tokens == 0
    return OutputOptions(
        logprobs=parsed.output_logprobs(),
        all_top=bool(parsed.logprob_token_ids),
        prompt_logprobs=parsed.prompt_logprobs_asked() is not None,
        echo=parsed.echo,
        echo_only=echo_only,
        as_token_ids=parsed.return_tokens_as_token_ids,
        return_token_ids=parsed.return_token_ids,
        continuous_usage=parsed.stream_options is not None
        and parsed.stream_options.continuous_usage_stats,
    )


def chat_echo_text(parsed: ChatCompletionRequest) -> str:
    """What chat's echo puts first: the last message, when it is the assistant's (vLLM)."""
    last = parsed.messages[-1]
    if not parsed.echo or last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content)


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The n choices with the highest cumulative logprob (all of them, in order, when n were
    sampled)."""
    if len(choices) == n:
        return choices
    return sorted(choices, key=lambda choice: choice.cumulative_logprob, reverse=True)[:n]


def total_usage(usages: list[Usage]) -> Usage:
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )
