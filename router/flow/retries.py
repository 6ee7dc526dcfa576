"""Starting a run: one attempt after another until a worker sends its first chunk.

Each attempt picks a decode worker, chooses the path (router/flow/route_choice.py; the prefill
worker too, when the path uses one) and sends the request on it. A decode worker found
unavailable before any token (it died, or left the pools a moment ago) is marked down and the
next attempt goes to another one, up to MAX_ATTEMPTS workers. A prefill worker lost before the
prompt's KV was complete is marked down too, and the prompt goes to another prefill worker, or,
with none left, the local path (counted in pdserve_prefill_lost_total). Only workers whose KV is
compatible are paired. With no decode or colocated worker left to try, an attempt first waits
up to --worker-wait (within the request's deadline) for one to join or come back: a record
that expired on one late heartbeat is back a heartbeat later, and a 503 for that blink would
fail a request the cluster can serve (a migration waits so too).
"""

import asyncio
import logging

from opentelemetry import trace

from pdserve.core import tracing
from pdserve.core.kinds import Role, RoutePath, RouteReason
from pdserve.costs.path_prices import RouteDecision, by_length, estimate
from pdserve.protocol import worker_pb2
from pdserve.settings.router import LENGTH, RouterSettings
from router.flow.disaggregation import PrefillOutcome, generate_disaggregated
from router.flow.migration import migrating
from router.flow.request_run import Admitted, RequestRun, Started
from router.flow.route_choice import ROUTE_HEADER, cluster_costs, worker_state
from router.http.errors import ErrorKind, OpenAIError
from router.metrics import RouterMetrics
from router.workers.client import WorkerClient
from router.workers.pool import TAKES_REQUESTS, WorkerPool

log = logging.getLogger("pdserve.router")
MAX_ATTEMPTS = 3  # workers of a role a request may try when they turn out unavailable


class Starter:
    """Starts runs on the pool's workers; counts each path taken and why."""

    def __init__(self, settings: RouterSettings, pool: WorkerPool, metrics: RouterMetrics):
        self.settings = settings
        self.pool = pool
        self.metrics = metrics

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
                    await result.chunks.aclose()
            raise failed[0]
        return results

    async def start(self, run: RequestRun, request: worker_pb2.GenerateRequest) -> Started:
        """Send the request on its path and wait for its first chunk; the rest migrate when
        their decode worker is lost (router/flow/migration.py)."""
        tried: set[str] = set()
        tried_prefill: set[str] = set()
        while True:
            wait_s = min(self.settings.worker_wait_s, run.time_left())
            await self.pool.wait_for_live(TAKES_REQUESTS, wait_s, frozenset(tried))
            with tracing.tracer().start_as_current_span("pdserve.route") as span:
                worker, prefill = self._workers(run, request, tried, tried_prefill)
                span.set_attributes(
                    {
                        "pdserve.path": str(run.route),
                        "pdserve.reason": str(run.decision.reason) if run.decision else "",
                        "pdserve.worker": worker.worker_id,
                        "pdserve.prefill_worker": prefill.worker_id if prefill else "",
                    }
                )
            chunks, headers = self._send(run, request, worker, prefill, len(tried_prefill))
            try:
                first = await anext(chunks)
            except OpenAIError as error:
                if error.kind == ErrorKind.PREFILL_UNAVAILABLE:
                    self._prefill_lost(run, prefill, tried_prefill, error)
                    continue
                if error.kind != ErrorKind.WORKER_UNAVAILABLE:
                    raise
                self.pool.mark_down(worker)
                tried.add(worker.address)
                trace.get_current_span().add_event(
                    "pdserve.retry", {"pdserve.worker": worker.worker_id, "why": error.message}
                )
                if len(tried) >= MAX_ATTEMPTS:
                    raise
                log.warning("request %s: %s; trying another worker", run.request_id, error.message)
                continue
            if run.prefill is not None and run.prefill.error_kind == ErrorKind.WORKER_UNAVAILABLE:
                self.pool.mark_down(prefill)
            self.metrics.routes.labels(run.route).inc()
            chunks = migrating(
                run, request, first, chunks, self.pool, self.metrics, self.settings.worker_wait_s
            )
            return Started(first, chunks, headers)

    def _workers(
        self,
        run: RequestRun,
        request: worker_pb2.GenerateRequest,
        tried: set[str],
        tried_prefill: set[str],
    ) -> tuple[WorkerClient, WorkerClient | None]:
        """This attempt's worker and, on the disaggregated path, its prefill worker."""
        prompt = request.prompt_token_ids
        worker = run.decode_worker = self.pool.pick(TAKES_REQUESTS, frozenset(tried), prompt=prompt)
        prefill = self._choose_path(run, worker, tried_prefill, request)
        if run.route == RoutePath.STAY_ON_PREFILL:  # the prefill worker takes the whole request
            worker, prefill = prefill, None
            run.decode_worker = worker
        if worker.address not in run.decode_holds:
            run.decode_holds[worker.address] = self.pool.cached_tokens(worker, prompt)
        self.pool.computes(worker, prompt)  # it computes the prompt, or receives its KV
        if prefill is not None:
            self.pool.computes(prefill, prompt)
        return worker, prefill

    def _send(
        self,
        run: RequestRun,
        request: worker_pb2.GenerateRequest,
        worker: WorkerClient,
        prefill: WorkerClient | None,
        attempt: int,
    ) -> tuple[object, dict]:
        """The attempt's stream of chunks (nothing is sent before its first is asked for) and
        its response headers."""
        headers = {
            "x-request-id": run.request_id,
            "x-pdserve-worker": worker.worker_id,
            ROUTE_HEADER: run.route,
        }
        request = self._with_pool_fetch(request, prefill or worker)
        if prefill is None:
            run.prefill = None
            return worker.generate(request, timeout=run.time_left()), headers
        run.prefill = PrefillOutcome(admission=self.settings.decode_admission)
        headers["x-pdserve-prefill-worker"] = prefill.worker_id
        chunks = generate_disaggregated(
            prefill,
            worker,
            request,
            self.settings.kv_timeout_s,
            run.time_left(),
            run.prefill,
            attempt=attempt,
            skip_tokens=run.decode_holds[worker.address],
        )
        return chunks, headers

    def _with_pool_fetch(
        self, request: worker_pb2.GenerateRequest, computing: WorkerClient
    ) -> worker_pb2.GenerateRequest:
        """The request as the worker that computes its prompt gets it: told to fetch the
        leading blocks another host's KV pool holds first, when that saves it time
        (router/workers/pool.py's pool_fetch). Not for a request that asks for its prompt's
        logprobs: vLLM computes its whole prompt, reading no cached KV."""
        if request.sampling.HasField("prompt_logprobs"):
            return request
        fetch = self.pool.pool_fetch(computing, request.prompt_token_ids)
        if fetch is None:
            return request
        fetching = worker_pb2.GenerateRequest()
        fetching.CopyFrom(request)
        fetching.pool_fetch.CopyFrom(fetch)
        return fetching

    def _choose_path(
        self,
        run: RequestRun,
        decode: WorkerClient,
        tried_prefill: set[str],
        request: worker_pb2.GenerateRequest,
    ) -> WorkerClient | None:
        """Decide the run's path (router/flow/route_choice.py) given its decode worker; returns the
        prefill worker when the path uses one. Every decision is counted by path and reason
        and kept in `run.decision` for the timing breakdown."""
        prompt = request.prompt_token_ids
        floor = self.settings.disaggregate_min_tokens
        decision = run.route_forced
        if decision is None and not [
            w for w in self.pool.live((Role.PREFILL,)) if w.address not in tried_prefill
        ]:
            decision = RouteDecision(RoutePath.LOCAL, RouteReason.NO_PREFILL_WORKER)
        elif decision is None and self.settings.route_policy == LENGTH:
            decision = by_length(len(prompt), floor)
        prefill = None
        if decision is None or decision.route != RoutePath.LOCAL:
            prefill = self._pick_prefill(run, decode, tried_prefill, prompt)
            if prefill is None:
                decision = RouteDecision(RoutePath.LOCAL, RouteReason.NO_PREFILL_WORKER)
        if decision is None:
            cluster = cluster_costs(self.pool.live((Role.PREFILL, *TAKES_REQUESTS)))
            decision = estimate(
                len(prompt),
                request.sampling.max_tokens * max(1, request.sampling.n),
                worker_state(decode, cluster, self.pool.reusable_tokens(decode, prompt)),
                worker_state(prefill, cluster, self.pool.reusable_tokens(prefill, prompt)),
                floor,
                decode_full=decode.load.full(decode.max_num_seqs),
            )
        run.decision = decision
        run.route = decision.route
        self.metrics.route_decisions.labels(decision.route, decision.reason).inc()
        return prefill if decision.route != RoutePath.LOCAL else None

    def _pick_prefill(
        self, run: RequestRun, decode: WorkerClient, tried: set[str], prompt
    ) -> WorkerClient | None:
        """A prefill worker whose KV `decode` can take; with none (all gone since admission, or
        all incompatible with it: a misconfigured pool) the request takes the local path,
        counted in pdserve_kv_fallbacks_total{policy="no_prefill"} and logged with why."""
        try:
            return self.pool.pick(
                (Role.PREFILL,), frozenset(tried), pairs_with=decode, prompt=prompt
            )
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
        trace.get_current_span().add_event(
            "pdserve.retry", {"pdserve.prefill_worker": prefill.worker_id, "why": error.message}
        )
        others = [w for w in self.pool.live((Role.PREFILL,)) if w.address not in tried]
        if others and len(tried) < MAX_ATTEMPTS:
            self.metrics.prefill_lost.labels("another_prefill").inc()
            log.warning(
                "request %s: %s; trying another prefill worker", run.request_id, error.message
            )
            return
        log.warning(
            "request %s: %s; no prefill worker left: local path", run.request_id, error.message
        )
        run.route_forced = RouteDecision(RoutePath.LOCAL, RouteReason.PREFILL_LOST)
        self.metrics.prefill_lost.labels(RoutePath.LOCAL).inc()
