"""A discrete-event simulator of a pdserve cluster: router, prefill pool, decode pool.

Kept apart from the runtime (no router, cluster or vLLM import) so a plan needs nothing
running; it mirrors the runtime's defaults instead:
- the router picks a prefill worker and a decode worker round-robin (pdserve's default policy)
  and chooses the request's path as the router does (pdserve/costs/path_prices.py, the same
  function): with `route_policy` "estimate" (the default) the cheaper of local and
  disaggregated, priced from the two workers' queues, batches, arrival rates over the last
  RATE_WINDOW_S and step costs (a calibrated cost model's own figures; the roofline's,
  linearized); with "length", disaggregated from `disaggregate_min_tokens` on. Prompts below
  that floor, and every prompt when there is no prefill worker, take the local path: the decode
  worker prefills them itself, and that step costs its decode batch plus the prefill.
  Stay-on-prefill is not modelled: the runtime takes it only when a decode worker is full;
- a prefill worker runs one step at a time over whole prompts from its FIFO queue, up to
  `prefill_token_budget` tokens per step (always at least one prompt; no chunking), and its
  step's end is the client's first token (pdserve's after-prefill admission);
- the KV then travels to the request's decode worker in latency + bytes / bandwidth, counted
  after the prefill ends (the runtime overlaps it with later layers, so this errs long);
- a decode worker admits arrived requests in FIFO order while its batch has room and its KV
  cache has blocks for the request's whole context (prompt + output, reserved at admission,
  so there is no preemption; a request that can never fit fails), and runs continuous
  batching: each step gives every running request one token, finished ones free their blocks.
- workers may share a host (`workers_per_host`: the prefill workers, then the decode workers,
  fill hosts in order, as `pdserve serve` starts them): while k other workers of its host are
  busy, a step runs 1 + k · contention times slower (on a CPU host, two engines on the same cores
  slow each other down, and so do the router, the client and the KV transfer they drive). A step
  is re-timed whenever a neighbour starts or ends one, so it pays for exactly the time they
  overlap. `prefill_contention` slows prefill workers' steps, `decode_contention` decode ones'.
HTTP and tokenization are not modelled (a calibrated cost model folds them into its steps).

The output is what `pdserve bench` records (RequestRecord per request, and the duration from
the start of the schedule to the last token), so bench.metrics.summarize gives the same
TTFT/TPOT percentiles and goodput for a prediction as for a measurement. There is no
randomness inside: the same requests give the same result.
"""

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.bench.records import RequestRecord
from pdserve.core.kinds import RoutePath
from pdserve.costs.path_prices import Arrivals, WorkerState, by_length, estimate
from pdserve.costs.step_costs import StepCosts
from pdserve.planner.cost_model import StepCost, linearized
from pdserve.settings.router import ESTIMATE, LENGTH, RouterSettings

DEFAULT_FLOOR = RouterSettings.model_fields["disaggregate_min_tokens"].default


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start of the schedule
    prompt_tokens: int
    output_tokens: int  # generated exactly (as with ignore_eos)


@dataclass(frozen=True)
class SimCluster:
    """Pools and the costs of their steps. KV figures are per decode replica (its whole TP
    group) and for the whole model (all TP ranks together)."""

    prefill_replicas: int
    decode_replicas: int
    prefill_cost: StepCost
    decode_cost: StepCost
    kv_capacity_tokens: int
    kv_bytes_per_token: int
    kv_bandwidth_bytes_per_s: float
    kv_latency_s: float = 0.0
    block_size: int = 16
    prefill_token_budget: int = 8192
    max_decode_batch: int = 256
    route_policy: str = ESTIMATE  # the router's --route-policy: "estimate" or "length"
    disaggregate_min_tokens: int = DEFAULT_FLOOR  # the router's --disaggregate-min-tokens
    workers_per_host: int = 1
    prefill_contention: float = 0.0
    decode_contention: float = 0.0


@dataclass
class _Job:
    index: int
    request: SimRequest
    blocks: int
    local: bool = False
    decode: "_DecodeWorker | None" = None  # chosen on arrival, as the router does
    token_times: list[float] = field(default_factory=list)

    @property
    def context(self) -> int:
        return self.request.prompt_tokens + len(self.token_times)

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.request.output_tokens


@dataclass(eq=False)
class _Worker:
    """A worker's step in progress: `work` seconds it would take alone, left at `since`, and the
    pace it runs at (1 alone; slower beside busy neighbours). `version` retires the end event of
    a step that was re-timed."""

    contention: float
    costs: StepCosts
    busy: bool = False
    work: float = 0.0
    since: float = 0.0
    pace: float = 1.0
    version: int = 0
    on_end: Callable[[], None] | None = None
    arrivals: Arrivals = field(default_factory=Arrivals)  # what the router sent it

    def state(self, now: float, queued_tokens: int, decoding: int) -> WorkerState:
        """What the router's estimate would know of this worker now."""
        rates = self.arrivals.rates(now)
        return WorkerState(queued_tokens, decoding, *rates, self.costs)


@dataclass(eq=False)
class _PrefillWorker(_Worker):
    queue: deque = field(default_factory=deque)
    in_step_tokens: int = 0  # prompt tokens of the step it is computing

    def queued_tokens(self) -> int:
        return self.in_step_tokens + sum(job.request.prompt_tokens for job in self.queue)


@dataclass(eq=False)
class _DecodeWorker(_Worker):
    free_blocks: int = 0
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    def queued_tokens(self) -> int:
        """Prompt tokens of the local requests it has yet to prefill."""
        waiting = [job for job in [*self.waiting, *self.running] if job.local]
        return sum(job.request.prompt_tokens for job in waiting if not job.token_times)

    def decoding(self) -> int:
        return sum(1 for job in self.running if job.token_times)


class _Simulation:
    def __init__(self, cluster: SimCluster):
        if cluster.decode_replicas < 1 or cluster.prefill_replicas < 0:
            raise ValueError("a cluster needs at least one decode worker")
        self.cluster = cluster
        self.capacity_blocks = cluster.kv_capacity_tokens // cluster.block_size
        if cluster.route_policy not in (ESTIMATE, LENGTH):
            raise ValueError(f"route_policy: {ESTIMATE} or {LENGTH}, not {cluster.route_policy!r}")
        prefill_costs, decode_costs = (
            linearized(cluster.prefill_cost),
            linearized(cluster.decode_cost),
        )
        self.prefills = [
            _PrefillWorker(cluster.prefill_contention, prefill_costs)
            for _ in range(cluster.prefill_replicas)
        ]
        self.decodes = [
            _DecodeWorker(cluster.decode_contention, decode_costs, free_blocks=self.capacity_blocks)
            for _ in range(cluster.decode_replicas)
        ]
        workers = [*self.prefills, *self.decodes]
        size = max(1, cluster.workers_per_host)
        self.host = {
            worker: workers[i - i % size : i - i % size + size] for i, worker in enumerate(workers)
        }
        self.next_prefill = itertools.cycle(self.prefills)
        self.next_decode = itertools.cycle(self.decodes)
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.sequence = itertools.count()  # ties break in scheduling order
        self.now = 0.0

    def run(self, requests: list[SimRequest]) -> list[_Job | None]:
        """Jobs in request order; None for a request that can never fit a decode worker."""
        jobs: list[_Job | None] = []
        for index, request in enumerate(requests):
            blocks = math.ceil(
                (request.prompt_tokens + request.output_tokens) / self.cluster.block_size
            )
            job = _Job(index, request, blocks) if blocks <= self.capacity_blocks else None
            jobs.append(job)
            if job is not None:
                self._at(request.arrival, lambda job=job: self._arrive(job))
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
        return jobs

    def _at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (time, next(self.sequence), action))

    def _start_step(self, worker: _Worker, work: float, on_end: Callable[[], None]) -> None:
        """Run a step of `work` seconds (alone) on `worker`; `on_end` when it is done."""
        self._settle(worker)
        worker.busy, worker.work, worker.since, worker.on_end = True, work, self.now, on_end
        self._pace(worker)

    def _end_step(self, worker: _Worker, version: int) -> None:
        if version != worker.version:
            return  # re-timed since: a later event ends it
        self._settle(worker)
        worker.busy = False
        self._pace(worker)
        worker.on_end()

    def _settle(self, worker: _Worker) -> None:
        """Count the work the busy workers of `worker`'s host did at their pace until now."""
        for neighbour in self.host[worker]:
            if neighbour.busy:
                neighbour.work = max(
                    0.0, neighbour.work - (self.now - neighbour.since) * neighbour.pace
                )
                neighbour.since = self.now

    def _pace(self, worker: _Worker) -> None:
        """Set the pace of the busy workers of `worker`'s host, and (re)schedule the end of each
        step whose pace changed (and of `worker`'s, just started)."""
        busy = [neighbour for neighbour in self.host[worker] if neighbour.busy]
        for neighbour in busy:
            pace = 1 / (1 + neighbour.contention * (len(busy) - 1))
            if pace != neighbour.pace or neighbour is worker:
                neighbour.pace = pace
                neighbour.version += 1
                self._at(
                    self.now + neighbour.work / pace,
                    lambda n=neighbour, v=neighbour.version: self._end_step(n, v),
                )

    def _arrive(self, job: _Job) -> None:
        job.decode = next(self.next_decode)
        prefill = next(self.next_prefill) if self.prefills else None
        job.local = prefill is None or self._route(job, prefill) == RoutePath.LOCAL
        job.decode.arrivals.sent(self.now, job.request.prompt_tokens)
        if job.local:
            self._enqueue_decode(job.decode, job)
        else:
            prefill.arrivals.sent(self.now, job.request.prompt_tokens)
            prefill.queue.append(job)
            self._step_prefill(prefill)

    def _route(self, job: _Job, prefill: _PrefillWorker) -> RoutePath:
        """The path the router would choose for `job` (see the module docstring)."""
        request, floor = job.request, self.cluster.disaggregate_min_tokens
        if self.cluster.route_policy == LENGTH:
            return by_length(request.prompt_tokens, floor).route
        decode = job.decode
        return estimate(
            request.prompt_tokens,
            request.output_tokens,
            decode.state(self.now, decode.queued_tokens(), decode.decoding()),
            prefill.state(self.now, prefill.queued_tokens(), 0),
            floor,
        ).route

    def _step_prefill(self, worker: _PrefillWorker) -> None:
        if worker.busy or not worker.queue:
            return
        batch = [worker.queue.popleft()]
        tokens = batch[0].request.prompt_tokens
        while (
            worker.queue
            and tokens + worker.queue[0].request.prompt_tokens <= self.cluster.prefill_token_budget
        ):
            tokens += worker.queue[0].request.prompt_tokens
            batch.append(worker.queue.popleft())
        step = self.cluster.prefill_cost.prefill_time([job.request.prompt_tokens for job in batch])
        worker.in_step_tokens = tokens
        self._start_step(worker, step, lambda: self._end_prefill(worker, batch))

    def _end_prefill(self, worker: _PrefillWorker, batch: list[_Job]) -> None:
        worker.in_step_tokens = 0
        for job in batch:
            job.token_times.append(self.now)
            if not job.done:
                transfer = (
                    self.cluster.kv_latency_s
                    + job.request.prompt_tokens
                    * self.cluster.kv_bytes_per_token
                    / self.cluster.kv_bandwidth_bytes_per_s
                )
                self._at(self.now + transfer, lambda job=job: self._enqueue_decode(job.decode, job))
        self._step_prefill(worker)

    def _enqueue_decode(self, worker: _DecodeWorker, job: _Job) -> None:
        worker.waiting.append(job)
        self._step_decode(worker)

    def _step_decode(self, worker: _DecodeWorker) -> None:
        if worker.busy:
            return
        admitted = []
        while (
            worker.waiting
            and len(worker.running) + len(admitted) < self.cluster.max_decode_batch
            and worker.waiting[0].blocks <= worker.free_blocks
        ):
            job = worker.waiting.popleft()
            worker.free_blocks -= job.blocks
            admitted.append(job)
        prefilling = [job for job in admitted if not job.token_times]
        worker.running += admitted
        decoding = [job for job in worker.running if job.token_times]
        if not worker.running:
            return
        cost = self.cluster.decode_cost
        step = (cost.decode_time([job.context for job in decoding]) if decoding else 0.0) + (
            cost.prefill_time([job.request.prompt_tokens for job in prefilling])
            if prefilling
            else 0.0
        )
        self._start_step(worker, step, lambda: self._end_decode(worker))

    def _end_decode(self, worker: _DecodeWorker) -> None:
        still_running = []
        for job in worker.running:  # the simulator's innermost loop: kept plain
            job.token_times.append(self.now)
            if len(job.token_times) >= job.request.output_tokens:
                worker.free_blocks += job.blocks
            else:
                still_running.append(job)
        worker.running = still_running
        self._step_decode(worker)


def simulate(cluster: SimCluster, requests: list[SimRequest]) -> tuple[list[RequestRecord], float]:
    """Run the requests through the cluster; returns (a record per request, in order; the
    duration from the schedule's start to the last token), as bench.runner.run does."""
    jobs = _Simulation(cluster).run(requests)
    records = [_record(request, job) for request, job in zip(requests, jobs, strict=True)]
    ends = [job.token_times[-1] for job in jobs if job is not None]
    return records, max(ends, default=max((r.arrival for r in requests), default=0.0))


def _record(request: SimRequest, job: _Job | None) -> RequestRecord:
    record = RequestRecord(
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.output_tokens,
        send_time=request.arrival,
    )
    if job is None:
        record.error = "needs more KV cache than a decode worker has"
        return record
    times = job.token_times
    record.ttft = times[0] - request.arrival
    record.itl = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    record.e2e = times[-1] - request.arrival
    record.output_chunks = len(times)
    return record
