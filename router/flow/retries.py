"""Starting a run: one attempt after another until a worker sends its first chunk.

Each attempt takes its choice from router/flow/route_choice.py's `choose` (the decode worker,
the path, the prefill worker when the path uses one, a pool fetch), over the run's PromptView,
made once per run, and sends the request on it; this module is the loop around it. A decode
worker found unavailable before any token (it died, or left the pools a moment ago) is marked
down and the next attempt goes to another one, up to MAX_ATTEMPTS workers. A prefill worker
lost before the prompt's KV was complete is marked down too, and the prompt goes to another
prefill worker, or, with none left, the local path (counted in pdserve_prefill_lost_total).
Only workers whose KV is compatible are paired. With no decode or colocated worker left to
try, an attempt first waits up to --worker-wait (within the request's deadline) for one to
join or come back: a record that expired on one late heartbeat is back a heartbeat later, and a
503 for that blink would fail a request the cluster can serve (a migration waits so too).
"""

import asyncio
import logging

from opentelemetry import trace

from pdserve.core import tracing
from pdserve.core.kinds import Role, RoutePath, RouteReason
from pdserve.costs.path_prices import RouteDecision
from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from router.flow.disaggregation import PrefillOutcome, generate_disaggregated
from router.flow.migration import migrating
from router.flow.request_run import Admitted, RequestRun, Started
from router.flow.route_choice import ROUTE_HEADER, Attempt, Tried, choose
from router.http.errors import ErrorKind, OpenAIError
from router.metrics import RouterMetrics
from router.workers.choice import WorkerChoice
from router.workers.data_parallel import on_rank
from router.workers.handle import WorkerHandle
from router.workers.pool import TAKES_REQUESTS, WorkerPool
from router.workers.prompt_view import PromptView

log = logging.getLogger("pdserve.router")
MAX_ATTEMPTS = 3  # workers of a role a request may try when they turn out unavailable


class Starter:
    """Starts runs on the pool's workers; counts each path taken and why."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: WorkerPool,
        choice: WorkerChoice,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.choice = choice
        self.metrics = metrics

    async def start_all(self, admitted: Admitted) -> list[Started]:
        """Start every run at once; if one fails, the others are closed (which aborts them on
        their workers) and its error raised. A lone run starts in the caller's task (a gather
        makes a task for it)."""
        if len(admitted.runs) == 1:
            return [await self.start(admitted.runs[0], admitted.worker_requests[0])]
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
                    await result.chunks.aclose()
            raise failed[0]
        return results

    async def start(self, run: RequestRun, request: worker_pb2.GenerateRequest) -> Started:
        """Send the request on its path and wait for its first chunk; the rest migrate when
        their decode worker is lost (router/flow/migration.py). The run's attempt and prefill
        leg are set once its first chunk came."""
        view = self.choice.prompt_view(request.prompt_token_ids)
        tried, forced = Tried(), run.route_forced
        while True:
            wait_s = min(self.settings.worker_wait_s, run.time_left())
            await self.pool.wait_for_live(TAKES_REQUESTS, wait_s, tried.decode)
            with tracing.tracer().start_as_current_span("pdserve.route") as span:
                attempt = choose(self.choice, view, self.settings, request.sampling, forced, tried)
                span.set_attributes(
                    {
                        "pdserve.path": str(attempt.route),
                        "pdserve.reason": str(attempt.decision.reason),
                        "pdserve.worker": attempt.decode.identity.worker_id,
                        "pdserve.prefill_worker": getattr(attempt.prefill, "worker_id", ""),
                    }
                )
            self._chosen(run, attempt, view)
            prefill = PrefillOutcome(admission=self.settings.decode_admission)
            chunks, headers = self._send(run, request, attempt, view, prefill, len(tried.prefill))
            try:
                first = await anext(chunks)
            except OpenAIError as error:
                if error.kind == ErrorKind.PREFILL_UNAVAILABLE:
                    tried, forced = self._prefill_lost(run, attempt.prefill, tried, forced, error)
                    continue
                if error.kind != ErrorKind.WORKER_UNAVAILABLE:
                    raise
                worker = attempt.decode
                self.pool.mark_down(worker)
                tried = Tried(tried.decode | {worker.address}, tried.prefill)
                trace.get_current_span().add_event(
                    "pdserve.retry",
                    {"pdserve.worker": worker.identity.worker_id, "why": error.message},
                )
                if len(tried.decode) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: %s; trying another worker", run.request_id, error.message)
                continue
            run.attempt, run.prefill = attempt, prefill if attempt.prefill is not None else None
            if attempt.prefill is not None and prefill.error_kind == ErrorKind.WORKER_UNAVAILABLE:
                self.pool.mark_down(attempt.prefill)
            self.metrics.routes.labels(attempt.route).inc()
            chunks = migrating(
                run,
                request,
                first,
                chunks,
                self.pool,
                self.choice,
                self.metrics,
                self.settings.worker_wait_s,
            )
            return Started(first, chunks, headers)

    def _chosen(self, run: RequestRun, attempt: Attempt, view: PromptView) -> None:
        """Count the attempt's path and why; say why no prefill worker was paired, if so; tell
        the policy which workers compute the prompt (or receive its KV)."""
        decision = attempt.decision
        self.metrics.route_decisions.labels(decision.route, decision.reason).inc()
        if attempt.unpaired is not None:
            log.warning("request %s: %s; local path", run.request_id, attempt.unpaired)
            self.metrics.kv_fallbacks.labels("no_prefill").inc()
        self.choice.policy.computes(attempt.decode, view.tokens)
        if attempt.prefill is not None:
            self.choice.policy.computes(attempt.prefill, view.tokens)

    def _send(
        self,
        run: RequestRun,
        request: worker_pb2.GenerateRequest,
        attempt: Attempt,
        view: PromptView,
        prefill: PrefillOutcome,
        number: int,
    ) -> tuple[object, dict]:
        """The attempt's stream of chunks (nothing is sent before its first is asked for) and
        its response headers. `number`: prefill workers lost so far (each retry is a new
        transfer)."""
        headers = {
            "x-request-id": run.request_id,
            "x-pdserve-worker": attempt.decode.identity.worker_id,
            ROUTE_HEADER: attempt.route,
        }
        if attempt.fetch is not None:
            fetching = worker_pb2.GenerateRequest()
            fetching.CopyFrom(request)
            fetching.pool_fetch.CopyFrom(attempt.fetch)
            request = fetching
        if attempt.prefill is None:
            request = on_rank(attempt.decode, request)
            return attempt.decode.generate(request, timeout=run.time_left()), headers
        headers["x-pdserve-prefill-worker"] = attempt.prefill.identity.worker_id
        chunks = generate_disaggregated(
            attempt.prefill,
            attempt.decode,
            request,
            self.settings.kv_timeout_s,
            run.time_left(),
            prefill,
            attempt=number,
            skip_tokens=view.cached_on(attempt.decode),  # what it held before this run
        )
        return chunks, headers

    def _prefill_lost(
        self,
        run: RequestRun,
        prefill: WorkerHandle,
        tried: Tried,
        forced: RouteDecision | None,
        error: OpenAIError,
    ) -> tuple[Tried, RouteDecision | None]:
        """Mark the lost prefill worker down; the next attempt goes to another one, or takes
        the local path (the returned forced decision) when none is left or MAX_ATTEMPTS were
        tried."""
        self.pool.mark_down(prefill)
        tried = Tried(tried.decode, tried.prefill | {prefill.address})
        trace.get_current_span().add_event(
            "pdserve.retry",
            {"pdserve.prefill_worker": prefill.identity.worker_id, "why": error.message},
        )
        others = [w for w in self.pool.live((Role.PREFILL,)) if w.address not in tried.prefill]
        if others and len(tried.prefill) < MAX_ATTEMPTS:
            self.metrics.prefill_lost.labels("another_prefill").inc()
            log.warning(
                "request %s: %s; trying another prefill worker", run.request_id, error.message
            )
            return tried, forced
        log.warning(
            "request %s: %s; no prefill worker left: local path", run.request_id, error.message
        )
        self.metrics.prefill_lost.labels(RoutePath.LOCAL).inc()
        return tried, RouteDecision(RoutePath.LOCAL, RouteReason.PREFILL_LOST)
