"""The router's HTTP app: OpenAI endpoints, health, metrics, and a worker stats view.

A request is validated and tokenized here, sent to a worker, and its chunks are relayed as
they come. The first chunk is awaited before the HTTP status is sent, so a request the worker
refuses gets a real 4xx/5xx even when streaming. A client that goes away cancels the relay,
which aborts the request on the worker.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from worker.protocol import worker_pb2
from worker.registry import Registry
from router.errors import (OpenAIError, context_length_exceeded, invalid_request, model_not_found,
                           worker_unavailable)
from router.metrics import RouterMetrics
from router.openai_types import (ChatCompletionRequest, CompletionRequest, SamplingFields,
                                 parse_request)
from router.responses import SSE_DONE, ChatFormat, CompletionFormat, ResponseFormat, Usage, sse
from router.tokenization import PromptTokenizer
from router.disaggregation import (DISAGGREGATED, LOCAL, ROUTE_HEADER,
                                   PrefillOutcome, choose_route,
                                   generate_disaggregated)
from router.policies import POLICIES
from settings.router import WITH_PREFILL, RouterSettings
from router.worker_client import WorkerClient
from router.worker_pool import WorkerPool, follow_registry

log = logging.getLogger("pdserve.router")
FINISH_REASONS = {"stop": "stop", "length": "length"}
TAKES_REQUESTS = ("decode", "colocated")
TIMING_HEADER = "x-pdserve-timing"  # ask for the timing breakdown in a whole response
MAX_ATTEMPTS = 3  # decode workers a request may try when they turn out unavailable
CANCEL_GRACE_S = 5.0  # how long a cancelled relay may take to unwind


@dataclass
class RequestRun:
    """One request's state while it is relayed; times are router monotonic seconds."""
    request_id: str
    prompt_tokens: int
    arrival: float
    route: str = LOCAL
    prefill: PrefillOutcome | None = None  # the prefill leg, when disaggregated
    decode_worker: WorkerClient | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_chunk: worker_pb2.GenerateChunk | None = None


def create_app(config: RouterSettings, model_dir: Path) -> FastAPI:
    pool = WorkerPool(list(config.worker_addresses), POLICIES[config.policy]())
    tokenizer = PromptTokenizer(model_dir)
    metrics = RouterMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_watch_down_workers(pool))]
        registry = None
        if config.registry:
            registry = Registry(config.registry, config.cluster)
            tasks.append(asyncio.create_task(
                follow_registry(pool, registry, config.registry_refresh_s)))
        else:
            await pool.wait_ready(config.worker_ready_timeout_s)
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if registry is not None:
            await registry.close()
        await pool.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.pool = pool

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        body = OpenAIError(error.status_code, str(error.detail), "invalid_request").body()
        return JSONResponse(body, status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception):
        log.exception("unexpected error on %s", request.url.path)
        metrics.errors.labels("internal").inc()
        body = OpenAIError(500, f"internal error: {type(error).__name__}: {error}", "internal",
                           type="server_error", code="internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        live = [w.worker_id for w in pool.workers if w.address not in pool.down]
        status = 200 if live else 503
        return JSONResponse({"status": "ok" if live else "unavailable", "workers": live},
                            status_code=status)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": config.served_model, "object": "model", "created": 0, "owned_by": "pdserve",
             "max_model_len": pool.max_model_len}]}

    @app.get("/pdserve/workers")
    async def worker_stats(fresh: bool = False):
        """Each worker's load, straight from its Stats RPC (`?fresh=true`: after an engine
        step, so KV usage reflects every finished and aborted request)."""
        rows = []
        for worker in pool.workers:
            row = {"address": worker.address, "worker_id": worker.worker_id, "role": worker.role}
            try:
                stats = await worker.stats(fresh=fresh)
                row.update(running_requests=stats.running_requests,
                           waiting_requests=stats.waiting_requests,
                           kv_blocks_used=stats.kv_blocks_used,
                           kv_blocks_total=stats.kv_blocks_total,
                           outstanding_prefill_tokens=stats.outstanding_prefill_tokens)
            except grpc.aio.AioRpcError as error:
                row["error"] = f"{error.code().name}: {error.details()}"
            rows.append(row)
        return {"workers": rows}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat", ChatCompletionRequest, ChatFormat, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions", CompletionRequest, CompletionFormat, "cmpl")

    async def _serve(request: Request, endpoint: str, schema: type[SamplingFields],
                     format_class: type[ResponseFormat], id_prefix: str) -> Response:
        arrival = time.monotonic()
        try:
            body = await _read_json(request)
            parsed = parse_request(schema, body)
            if parsed.model != config.served_model:
                raise model_not_found(parsed.model, config.served_model)
            if isinstance(parsed, ChatCompletionRequest):
                prompt_ids = tokenizer.chat(parsed)
            else:
                prompt_ids = tokenizer.completion(parsed)
            run = RequestRun(f"{id_prefix}-{uuid.uuid4().hex}", len(prompt_ids), arrival)
            if not pool.max_model_len:
                raise worker_unavailable("no worker has joined the pools yet; retry later")
            worker_request = worker_pb2.GenerateRequest(
                request_id=run.request_id, prompt_token_ids=prompt_ids,
                sampling=_sampling(parsed, len(prompt_ids), pool.max_model_len,
                                   config.default_max_tokens, param=_prompt_param(endpoint)))
            run.route = choose_route(request.headers.get(ROUTE_HEADER), len(prompt_ids),
                                     config.disaggregate_min_tokens, bool(pool.live(("prefill",))))
            first, chunks, headers = await _start(run, worker_request)
            metrics.routes.labels(run.route).inc()
            response_format = format_class(run.request_id, config.served_model)
            if parsed.stream:
                return StreamingResponse(
                    _stream(run, first, chunks, response_format, parsed.include_usage_in_stream(),
                            endpoint),
                    media_type="text/event-stream", headers=headers)
            whole = await _until_disconnected(
                request, _collect(run, first, chunks, response_format, endpoint), endpoint)
            if whole is None:
                return Response(status_code=499)
            # Prompt tokens the serving worker did not compute itself (prefix cache + KV
            # received); on a disaggregated request it shows the decode worker's saving.
            headers["x-pdserve-decode-cached-tokens"] = str(run.cached_tokens)
            if request.headers.get(TIMING_HEADER):
                whole["pdserve_timing"] = _timing_breakdown(run)
            return JSONResponse(whole, headers=headers)
        except OpenAIError as error:
            return _error_response(error, endpoint)

    async def _start(run: RequestRun, worker_request: worker_pb2.GenerateRequest):
        """Send the request on its path and wait for its first chunk. A decode worker found
        unavailable before any token (it died, or left the pools a moment ago) is marked down
        and the request goes to another one, up to MAX_ATTEMPTS workers."""
        tried: set[str] = set()
        while True:
            worker = run.decode_worker = pool.pick(TAKES_REQUESTS, frozenset(tried))
            headers = {"x-request-id": run.request_id, "x-pdserve-worker": worker.worker_id,
                       ROUTE_HEADER: run.route}
            if run.route == DISAGGREGATED:
                prefill = pool.pick(("prefill",))
                run.prefill = PrefillOutcome(admission=config.decode_admission)
                chunks = generate_disaggregated(prefill, worker, worker_request,
                                                config.kv_timeout_s, config.request_timeout_s,
                                                run.prefill)
                headers["x-pdserve-prefill-worker"] = prefill.worker_id
            else:
                chunks = worker.generate(worker_request, timeout=config.request_timeout_s)
            try:
                first = await anext(chunks)
            except OpenAIError as error:
                if error.kind != "worker_unavailable":
                    raise
                pool.mark_down(worker)
                tried.add(worker.address)
                if len(tried) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: %s; trying another worker", run.request_id,
                            error.message)
                continue
            if run.prefill is not None and run.prefill.error_kind == "worker_unavailable":
                pool.mark_down(prefill)
            return first, chunks, headers

    def _error_response(error: OpenAIError, endpoint: str) -> JSONResponse:
        metrics.errors.labels(error.kind).inc()
        metrics.requests.labels(endpoint, str(error.status)).inc()
        if error.status >= 500:
            log.warning("%s: %s", error.kind, error.message)
        return JSONResponse(error.body(), status_code=error.status)

    def _on_chunk(run: RequestRun, chunk: worker_pb2.GenerateChunk) -> None:
        if not chunk.token_ids:
            return
        now = time.monotonic()
        if run.last_token_at is None:
            run.first_token_at = now
            metrics.ttft.observe(now - run.arrival)
        else:
            metrics.inter_token.observe(now - run.last_token_at)
        run.last_token_at = now
        run.completion_tokens += len(chunk.token_ids)
        run.cached_tokens = chunk.cached_tokens
        run.last_chunk = chunk

    def _finish(run: RequestRun, endpoint: str) -> Usage:
        metrics.e2e.observe(time.monotonic() - run.arrival)
        metrics.prompt_tokens.inc(run.prompt_tokens)
        metrics.generation_tokens.inc(run.completion_tokens)
        metrics.requests.labels(endpoint, "200").inc()
        cached = run.cached_tokens
        if run.route == DISAGGREGATED:
            cached = _account_transfer(run)
        log.info("timing %s", json.dumps(_timing_breakdown(run)))
        return Usage(run.prompt_tokens, run.completion_tokens, cached)

    def _account_transfer(run: RequestRun) -> int:
        """KV metrics of a disaggregated request; returns its prompt-cache hit, which happened
        on the prefill worker (the decode worker's count includes the transferred KV)."""
        prefill = run.prefill.chunk
        cached_on_prefill = prefill.cached_tokens if prefill is not None else 0
        if run.prefill.ended_request:
            return cached_on_prefill
        decode = run.last_chunk
        if decode is not None and decode.HasField("kv"):
            metrics.kv_bytes.observe(decode.kv.bytes)
            metrics.kv_seconds.observe(decode.kv.seconds)
            if decode.kv.failed:
                metrics.kv_failures.labels("timeout_or_cancelled").inc()
        if run.prefill.error is not None:
            metrics.kv_failures.labels("prefill_failed").inc()
        if run.cached_tokens < run.prompt_tokens:  # the decode worker prefilled after all
            metrics.kv_fallbacks.labels("recompute").inc()
            log.warning("request %s fell back to local prefill on %s", run.request_id,
                        run.decode_worker.worker_id)
        return cached_on_prefill

    async def _relay(run: RequestRun, first, chunks):
        """Yield (text, finish_reason or None) per chunk, ending with the finish reason."""
        async def all_chunks():
            yield first
            async for chunk in chunks:
                yield chunk

        async for chunk in all_chunks():
            _on_chunk(run, chunk)
            if not chunk.finish_reason:
                yield chunk.text, None
                continue
            if chunk.finish_reason not in FINISH_REASONS:
                raise OpenAIError(502, f"the worker ended the request: {chunk.finish_reason}",
                                  "worker_error", type="server_error", code="worker_error")
            yield chunk.text, FINISH_REASONS[chunk.finish_reason]
            return

    async def _collect(run, first, chunks, response_format, endpoint) -> dict:
        parts, finish_reason = [], "stop"
        try:
            async for text, reason in _relay(run, first, chunks):
                parts.append(text)
                finish_reason = reason or finish_reason
            if run.prefill is not None:  # before closing the legs, which cancels the prefill
                await run.prefill.wait()
        finally:
            await chunks.aclose()
        return response_format.whole("".join(parts), finish_reason, _finish(run, endpoint))

    async def _stream(run, first, chunks, response_format, include_usage, endpoint):
        is_first = True
        try:
            async for text, reason in _relay(run, first, chunks):
                # As vLLM does, the finish reason rides on the last token's chunk: a separate
                # empty chunk would look like one more token to clients that time tokens.
                if text or is_first or reason is not None:
                    yield response_format.chunk(text, reason, is_first)
                    is_first = False
            if run.prefill is not None:  # before closing the legs, which cancels the prefill
                await run.prefill.wait()
            usage = _finish(run, endpoint)
            if include_usage:
                yield response_format.usage_chunk(usage)
        except OpenAIError as error:
            _error_response(error, endpoint)
            yield sse(error.body())
        except asyncio.CancelledError:
            metrics.errors.labels("client_disconnect").inc()
            metrics.requests.labels(endpoint, "499").inc()
            raise
        finally:
            await chunks.aclose()
        yield SSE_DONE

    async def _until_disconnected(request: Request, work, endpoint: str):
        """Run `work`; if the client leaves first, cancel it (which aborts the request on the
        worker) and answer 499, which nobody reads but the metrics count."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    metrics.errors.labels("client_disconnect").inc()
                    metrics.requests.labels(endpoint, "499").inc()
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)

    return app


def _timing_breakdown(run: RequestRun) -> dict:
    """Where the time to first token went, from both workers' engine timestamps (seconds)."""
    breakdown = {"request_id": run.request_id, "route": run.route,
                 "ttft": run.first_token_at - run.arrival if run.first_token_at else None}
    decode = run.last_chunk.timing if run.last_chunk is not None else None
    if run.route == LOCAL and decode is not None:
        breakdown.update(queue=decode.queued_seconds, prefill=decode.prefill_seconds)
    elif run.prefill is not None and run.prefill.chunk is not None and decode is not None:
        prefill = run.prefill.chunk.timing
        # The decode leg waits for the KV from its admission on; what it waits after the
        # prefill ended is the transfer time the prefill's compute did not hide.
        waited_during_prefill = (prefill.queued_seconds + prefill.prefill_seconds
                                 if run.prefill.admission == WITH_PREFILL else 0.0)
        breakdown.update(queue=prefill.queued_seconds, prefill=prefill.prefill_seconds,
                         transfer_wait=decode.queued_seconds,
                         exposed_transfer=max(0.0, decode.queued_seconds - waited_during_prefill),
                         first_decode_step=decode.prefill_seconds)
    if run.last_chunk is not None and run.last_chunk.HasField("kv"):
        breakdown.update(kv_bytes=run.last_chunk.kv.bytes, kv_seconds=run.last_chunk.kv.seconds)
    return breakdown


async def _watch_down_workers(pool: WorkerPool) -> None:
    while True:
        await asyncio.sleep(2.0)
        await pool.refresh()


async def _read_json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"the request body is not valid JSON: {error}") from None


def _prompt_param(endpoint: str) -> str:
    return "messages" if endpoint == "chat" else "prompt"


def _sampling(parsed: SamplingFields, prompt_tokens: int, max_model_len: int,
              default_max_tokens: int, param: str) -> worker_pb2.SamplingParams:
    asked = parsed.max_tokens_asked()
    room = max_model_len - prompt_tokens
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room or room < 1:
        raise context_length_exceeded(prompt_tokens, max(max_tokens, 1), max_model_len, param)
    sampling = worker_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
        top_k=parsed.top_k, stop=parsed.stop_list(), presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty, ignore_eos=parsed.ignore_eos)
    if parsed.seed is not None:
        sampling.seed = parsed.seed
    return sampling
