"""Accounting: what a request counts in the router's metrics, and the usage it reports.

Per chunk: time to first token, inter-token gaps, tokens relayed. Per run (one prompt) at its
end: latency, tokens, the KV transfer's figures, and its timing breakdown in the log. Per HTTP
request, once however many prompts it had: pdserve_requests_total by status.
"""

import json
import logging
import time

from opentelemetry import trace

from pdserve.core import tracing
from pdserve.core.kinds import KV_NOT_HELD, RoutePath
from pdserve.protocol import worker_pb2
from pdserve.settings.router import WITH_PREFILL
from router.flow.request_run import RequestRun
from router.http.errors import ErrorKind, OpenAIError
from router.http.responses import Usage
from router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
DISCONNECTED = 499  # the status a request whose client left is counted under (nginx's)


class Accounting:
    def __init__(self, metrics: RouterMetrics, cache_lost=lambda worker: None) -> None:
        self.metrics = metrics
        self.cache_lost = cache_lost  # called with a decode worker that lacked a skipped prefix

    def chunk(self, run: RequestRun, chunk: worker_pb2.GenerateChunk) -> None:
        """A chunk relayed to the client."""
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
        if not run.migrations and chunk.index == 0:  # the first worker's, first choice's
            run.cached_tokens = chunk.cached_tokens
            run.last_chunk = chunk

    def finish(self, run: RequestRun) -> Usage:
        """A run that relayed its last token: its figures, and its usage."""
        metrics = self.metrics
        metrics.e2e.observe(time.monotonic() - run.arrival)
        metrics.prompt_tokens.inc(run.prompt_tokens)
        metrics.generation_tokens.inc(run.completion_tokens)
        cached = run.cached_tokens
        if run.route == RoutePath.DISAGGREGATED:
            cached = self._transfer(run)
        log.info("timing %s", json.dumps(timing_breakdown(run)))
        return Usage(run.prompt_tokens, run.completion_tokens, cached)

    def _transfer(self, run: RequestRun) -> int:
        """KV metrics of a disaggregated run; returns its prompt-cache hit, which happened on
        the prefill worker (the decode worker's count includes the transferred KV)."""
        metrics = self.metrics
        prefill = run.prefill.chunk
        cached_on_prefill = prefill.cached_tokens if prefill is not None else 0
        if run.prefill.ended_request:
            return cached_on_prefill
        decode = run.last_chunk
        if decode is not None and decode.HasField("kv"):
            carrier = decode.kv.transport or run.prefill.transport  # gloo for nccl on CPUs
            metrics.kv_bytes.labels(carrier).observe(decode.kv.bytes)
            metrics.kv_seconds.labels(carrier).observe(decode.kv.seconds)
            _kv_transfer_span(run, decode.kv, carrier)
            if decode.kv.failed:
                metrics.kv_failures.labels(decode.kv.failure or "timeout").inc()
            if decode.kv.failure == KV_NOT_HELD:
                self.cache_lost(run.decode_worker)
        failed = run.prefill.error is not None or (decode is not None and decode.kv.failed)
        outcome = "failed" if failed else "loaded"
        metrics.kv_transfers.labels(run.prefill.transport, outcome).inc()
        if run.prefill.error is not None:
            metrics.kv_failures.labels("prefill_failed").inc()
        if run.cached_tokens < run.prompt_tokens:  # the decode worker prefilled after all
            metrics.kv_fallbacks.labels("recompute").inc()
            log.warning(
                "request %s fell back to local prefill on %s",
                run.request_id,
                run.decode_worker.identity.worker_id,
            )
        return cached_on_prefill

    def served(self, endpoint: str) -> None:
        """An HTTP request whose every run finished."""
        self.metrics.requests.labels(endpoint, "200").inc()

    def error(self, error: OpenAIError, endpoint: str) -> None:
        """An HTTP request that failed (before its response started, or during its stream)."""
        self.metrics.errors.labels(error.kind).inc()
        self.metrics.requests.labels(endpoint, str(error.status)).inc()
        if error.status >= 500:
            log.warning("%s: %s", error.kind, error.message)

    def disconnect(self, endpoint: str) -> None:
        """An HTTP request whose client went away first."""
        self.metrics.errors.labels(ErrorKind.CLIENT_DISCONNECT).inc()
        self.metrics.requests.labels(endpoint, str(DISCONNECTED)).inc()


def total_usage(usages: list[Usage]) -> Usage:
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
    )


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
    if run.route in (RoutePath.LOCAL, RoutePath.STAY_ON_PREFILL) and decode is not None:
        breakdown.update(queue=decode.queued_seconds, prefill=decode.prefill_seconds)
    elif run.prefill is not None and run.prefill.chunk is not None and decode is not None:
        breakdown.update(_disaggregated_timing(run, decode))
    if run.last_chunk is not None and run.last_chunk.HasField("kv"):
        kv = run.last_chunk.kv
        chosen = run.prefill.transport if run.prefill is not None else ""
        breakdown.update(
            kv_transport=chosen or kv.transport,  # the router's choice (grpc, nccl, shm)
            kv_backend=kv.transport,  # what carried it: gloo for nccl between CPU workers
            kv_bytes=kv.bytes,
            kv_seconds=kv.seconds,
        )
    return breakdown


def _disaggregated_timing(run: RequestRun, decode: worker_pb2.RequestTiming) -> dict:
    prefill = run.prefill.chunk.timing
    # The decode leg waits for the KV from its admission on; what it waits after the prefill
    # ended is the transfer time the prefill's compute did not hide.
    waited_during_prefill = (
        prefill.queued_seconds + prefill.prefill_seconds
        if run.prefill.admission == WITH_PREFILL
        else 0.0
    )
    return dict(
        queue=prefill.queued_seconds,
        prefill=prefill.prefill_seconds,
        transfer_wait=decode.queued_seconds,
        exposed_transfer=max(0.0, decode.queued_seconds - waited_during_prefill),
        first_decode_step=decode.prefill_seconds,
    )


def _kv_transfer_span(run: RequestRun, kv, carrier: str) -> None:
    """The KV transfer as the decode worker measured it, ending when its first token came."""
    if not tracing.tracing() or run.trace is None:
        return
    loaded_at = run.second_token_at or run.first_token_at or time.monotonic()
    end_ns = time.time_ns() - round((time.monotonic() - loaded_at) * 1e9)
    span = tracing.tracer().start_span(
        "pdserve.kv_transfer",
        context=run.trace,
        start_time=end_ns - round(kv.seconds * 1e9),
        attributes={
            "pdserve.transport": carrier,
            "pdserve.kv_bytes": kv.bytes,
            "pdserve.failed": kv.failed,
        },
    )
    if kv.failed:
        span.set_status(trace.StatusCode.ERROR, kv.failure or "timeout")
    span.end(end_time=end_ns)
