"""Migration: a decode worker lost mid-stream (UNAVAILABLE after some tokens) is marked down,
and another decode worker continues the request from the prompt plus the tokens already
relayed (computed there as prompt: greedy output is what an undisturbed run gives), with
max_tokens reduced by as many. The client sees one stream, no token twice or missing."""

import logging
import time

from pdserve.worker.protocol import worker_pb2
from router.errors import ErrorKind, OpenAIError
from router.metrics import RouterMetrics
from router.request_run import RequestRun
from router.worker_pool import TAKES_REQUESTS, WorkerPool

log = logging.getLogger("pdserve.router")
MAX_MIGRATIONS = 2  # times a request may move on after its decode worker was lost mid-stream


async def migrating(
    run: RequestRun,
    request: worker_pb2.GenerateRequest,
    chunks,
    pool: WorkerPool,
    metrics: RouterMetrics,
):
    """The request's chunks, from `chunks` and, each time its decode worker is lost, from the
    next one (up to MAX_MIGRATIONS; never for n choices, which do not migrate yet)."""
    current = chunks
    lost_at = None
    try:
        while True:
            try:
                async for chunk in current:
                    if lost_at is not None:
                        gap = time.monotonic() - lost_at
                        metrics.migration_gap.observe(gap)
                        log.info("request %s resumed %.3f s later", run.request_id, gap)
                        lost_at = None
                    yield chunk
                return
            except OpenAIError as error:
                if not _migrates(run, error):
                    raise
                lost_at = time.monotonic()
                pool.mark_down(run.decode_worker)
                await current.aclose()
                current = continuation(run, request, pool, metrics)
                log.warning(
                    "request %s: %s after %d tokens; continuing on %s",
                    run.request_id,
                    error.message,
                    len(run.token_ids),
                    run.decode_worker.worker_id,
                )
    finally:
        await current.aclose()


def _migrates(run: RequestRun, error: OpenAIError) -> bool:
    return (
        error.kind == ErrorKind.WORKER_UNAVAILABLE
        and run.migrations < MAX_MIGRATIONS
        and run.choices == 1
    )


def continuation(
    run: RequestRun, request: worker_pb2.GenerateRequest, pool: WorkerPool, metrics: RouterMetrics
):
    """The rest of the request on another decode worker (local path: it computes the prompt
    and the relayed tokens itself), within the request's remaining time."""
    run.migrations += 1
    metrics.migrations.inc()
    worker = run.decode_worker = pool.pick(TAKES_REQUESTS)
    rest = worker_pb2.GenerateRequest()
    rest.CopyFrom(request)
    rest.ClearField("kv")
    rest.sampling.ClearField("prompt_logprobs")  # the client has them already
    rest.request_id = f"{run.request_id}-m{run.migrations}"
    rest.prompt_token_ids.extend(run.token_ids)
    rest.sampling.max_tokens -= len(run.token_ids)
    rest.sampling.min_tokens = max(0, rest.sampling.min_tokens - len(run.token_ids))
    return worker.generate(rest, timeout=run.time_left())
