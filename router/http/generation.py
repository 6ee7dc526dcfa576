"""The OpenAI generation endpoints: /v1/chat/completions and /v1/completions.

The routes only translate HTTP to the request's steps and back: admit (router/flow/admission.py,
in the tokenizer's threads, or on the event loop for a small body), a turn
(router/flow/admission_gate.py), start (router/flow/retries.py), relay (router/flow/relay.py),
each failure counted (router/flow/accounting.py).
The first chunk is awaited before the HTTP status is sent, so a request the worker refuses gets
a real 4xx/5xx even when streaming. A client that goes away, before its first token or after,
cancels the request: a queued one leaves the queue, a started one is aborted on the workers.
"""

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.requests import ClientDisconnect

from pdserve.core import tracing
from pdserve.settings import json_logs
from router.flow.accounting import DISCONNECTED, timing_breakdown
from router.flow.admission import (
    PRIORITY_HEADER,
    TIMEOUT_HEADER,
    HttpAsk,
    admit,
    admits_inline,
    asking,
    sequences,
)
from router.flow.admission_gate import Turn
from router.flow.request_run import Admitted, Started
from router.flow.route_choice import ROUTE_HEADER
from router.http.api_keys import Caller, caller_of
from router.http.body import json_body, read_json
from router.http.errors import OpenAIError
from router.http.openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.http.responses import ChatShape, CompletionShape, ResponseShape
from router.workers.prefix_index import cache_salt

routes = APIRouter()
TIMING_HEADER = "x-pdserve-timing"  # ask for the timing breakdown in a whole response
WORKER_HEADERS = ("x-pdserve-worker", "x-pdserve-prefill-worker")


@routes.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    return await serve(request, "chat", ChatCompletionRequest, ChatShape, "chatcmpl")


@routes.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request):
    return await serve(request, "completions", CompletionRequest, CompletionShape, "cmpl")


async def serve(
    request: Request,
    endpoint: str,
    schema: type[SamplingFields],
    shape_class: type[ResponseShape],
    id_prefix: str,
) -> Response:
    """Admit, wait for a turn, start every run, then stream or collect the response; every
    failure is answered as an OpenAI error and counted once. The request's span (its trace's
    root, or a child of an operator's or admin's `traceparent`) ends with its response."""
    state = request.app.state
    arrival = time.monotonic()
    caller = caller_of(state, request.headers)  # what its API key may set (router/http/api_keys.py)
    span = tracing.tracer().start_span(  # a client's trace goes on only if it is trusted
        f"pdserve {endpoint}",
        **tracing.from_client(request.headers, caller.steers),
        kind=trace.SpanKind.SERVER,
    )
    trace_context = trace.set_span_in_context(span)
    attached = otel_context.attach(trace_context)
    streaming = False
    try:
        body = await read_json(request)

        async def begin() -> tuple[Admitted, Turn, list[Started]]:
            """Admit, wait for a turn, and start every run (their first chunk come)."""
            ask = HttpAsk(
                endpoint,
                schema,
                body,
                id_prefix,
                arrival,
                request.headers.get(ROUTE_HEADER),
                request.headers.get(TIMEOUT_HEADER),
                request.headers.get(PRIORITY_HEADER),
                caller,
                trace_context,
            )
            if admits_inline(body, _content_length(request)):
                admitted = admit(state.settings, state.pool, state.tokenizer, ask)
            else:
                admitted = await state.tokenizing.run(
                    admit, state.settings, state.pool, state.tokenizer, ask
                )
            json_logs.request_id.set(admitted.request_id)  # set in the thread's copy of it
            span.set_attribute("pdserve.request_id", admitted.request_id)
            cache_salt.set(admitted.worker_requests[0].cache_salt)  # the prefix index salt
            with tracing.tracer().start_as_current_span("pdserve.admission"):  # the queue's wait
                turn = await state.gate.enter(asking(admitted, state.settings), sequences(admitted))
            try:
                started = await state.starter.start_all(admitted)
            except BaseException:
                turn.give_back()
                raise
            return admitted, turn, started

        begun = await _unless_client_leaves(request.receive, begin())
        if begun is None:
            state.accounting.disconnect(endpoint)
            return Response(status_code=DISCONNECTED)
        admitted, turn, started = begun  # (`begin` set the log's request id and the salt)
        turn.first_token()
        headers = _visible_headers(started[0].headers, caller)
        headers["x-request-id"] = admitted.request_id
        shape = shape_class(
            admitted.request_id,
            state.settings.served_model,
            admitted.options,
            state.tokenizer.token_text,
        )
        if admitted.stream:
            events = state.relay.stream(admitted, started, shape, endpoint)
            streaming = True  # the span ends with the stream

            async def release() -> None:
                await events.aclose()
                for leg in started:  # when the stream never started, its own close did not
                    await leg.chunks.aclose()
                turn.give_back()
                span.end()

            return _ReleasingStream(
                events,
                release,
                trace_context,
                media_type="text/event-stream",
                headers=headers,
            )
        return await _whole(request, endpoint, admitted, started, shape, turn, headers, caller)
    except ClientDisconnect:  # it left while sending its body
        state.accounting.disconnect(endpoint)
        return Response(status_code=DISCONNECTED)
    except OpenAIError as error:
        state.accounting.error(error, endpoint)
        span.set_status(trace.StatusCode.ERROR, error.message)
        span.set_attribute("http.response.status_code", error.status)
        retry = {"retry-after": str(error.retry_after_s)} if error.retry_after_s else None
        return JSONResponse(error.body(), status_code=error.status, headers=retry)
    finally:
        otel_context.detach(attached)
        if not streaming:
            span.end()


def _content_length(request: Request) -> int | None:
    """The body's size as its request declared it (None for a chunked body)."""
    declared = request.headers.get("content-length", "")
    return int(declared) if declared.isdigit() else None


def _visible_headers(headers: dict, caller: Caller) -> dict:
    """The response's headers; which workers served it (their ids: pod names, or addresses)
    only for operator and admin keys (security review M7)."""
    if caller.steers:
        return dict(headers)
    return {key: value for key, value in headers.items() if key not in WORKER_HEADERS}


async def _unless_client_leaves(receive, work):
    """`work`'s result, or None when the client leaves first (security review M6): the task
    serving the request is cancelled then, so a request waiting in the admission queue leaves
    it, and one whose runs are starting or being collected is aborted on its workers. uvicorn
    does not cancel a handler whose client left, and nothing else reads the connection before
    the response starts. `work` runs in the serving task itself: a task of its own, and a wait
    for the first of two, cost a short request more of the router's CPU than the watch."""
    task = asyncio.current_task()
    watching, left = True, False

    def cancel_work(watch: asyncio.Future) -> None:
        nonlocal left
        if watching and not watch.cancelled():
            watch.exception()  # a failed receive counts as a client gone, as before
            left = True
            task.cancel()

    watch = asyncio.ensure_future(_client_left(receive))
    watch.add_done_callback(cancel_work)
    try:
        result = await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:  # only the watch cancelled it
            return None
        raise
    finally:
        watching = False  # a watch done in this step has its callback still to run
        watch.cancel()
    if left:  # `work` ended as the client left, and did not take the cancel: none is due now
        task.uncancel()
    return result


async def _client_left(receive) -> None:
    """Returns when the client disconnects (the body has been read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _whole(
    request: Request,
    endpoint: str,
    admitted: Admitted,
    started: list[Started],
    shape: ResponseShape,
    turn: Turn,
    headers: dict,
    caller: Caller,
) -> Response:
    """The whole response, once every run has finished (499 when the client left first);
    its timing breakdown for operator and admin keys that ask for it."""
    relay = request.app.state.relay
    try:
        whole = await _unless_client_leaves(
            request.receive, relay.collect(admitted, started, shape, endpoint)
        )
    finally:
        turn.give_back()
    if whole is None:
        request.app.state.accounting.disconnect(endpoint)
        return Response(status_code=DISCONNECTED)
    # Prompt tokens the serving worker did not compute itself (prefix cache + KV received); on
    # a disaggregated request it shows the decode worker's saving.
    cached = sum(run.cached_tokens for run in admitted.runs)
    headers["x-pdserve-decode-cached-tokens"] = str(cached)
    if request.headers.get(TIMING_HEADER) and caller.steers:
        whole["pdserve_timing"] = timing_breakdown(admitted.runs[0])
    return JSONResponse(whole, headers=headers)


class _ReleasingStream(StreamingResponse):
    """A stream whose request is released however the stream ends: its turn given back, its
    runs' legs closed (which aborts them on the workers) and its span ended, even when the
    client left before the first event was read (its generators never started, so their own
    `finally` never runs) or between two events (they stay suspended). Its events are made in
    the request's trace context (a migration's calls join its trace), attached once for the
    whole response. The events are sent from the serving task, the client's leaving watched as
    a waiting request's is (`_unless_client_leaves`): Starlette's own streaming ran a task group
    of two more tasks per stream (the events' and a disconnect listener's) and checked each
    event's type."""

    def __init__(self, content, release, trace_context, **options) -> None:
        super().__init__(content, **options)
        self.release = release
        self.trace_context = trace_context

    async def __call__(self, scope, receive, send) -> None:
        attached = otel_context.attach(self.trace_context)
        try:
            await _unless_client_leaves(receive, self._send_events(send))
        finally:
            try:
                await self.body_iterator.aclose()
                await self.release()
            finally:
                otel_context.detach(attached)

    async def _send_events(self, send) -> None:
        status, headers = self.status_code, self.raw_headers
        await send({"type": "http.response.start", "status": status, "headers": headers})
        async for event in self.body_iterator:  # SSE lines (str)
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
