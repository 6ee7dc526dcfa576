"""Which path a request takes, priced from the live state of the workers it could use.

Three paths, none best everywhere:
- local: its decode worker prefills the prompt itself; no KV moves;
- disaggregated: a prefill worker computes the prompt and pushes its KV to the decode worker;
- stay-on-prefill: the prefill worker computes the prompt and decodes it too (what Dynamo calls
  prefill-continues-decode); no KV moves. Only priced when the decode worker is full (it runs
  as many requests as its engine takes at once): measured here, letting requests stay whenever
  the estimate favoured it filled the prefill worker with decoding requests, which every later
  long prompt then stalled (SLO attainment at 1.5 req/s on the mixed workload: 75% against 92%
  without).

`--route-policy estimate` (the default) prices each path in seconds, summed over every request
it touches, and takes the cheapest:
- the request's own time: to its first token (the prompt tokens queued on the worker that
  prefills, then its own less those likely in that worker's prefix cache (`--policy
  cache-aware` knows them; other policies count none), at that worker's cost per token) and to
  its last (its expected output tokens at the decode step its worker will run, one sequence
  more than now, stretched by the share of that worker's time its arriving prompts take: a
  worker that prefills most of the time decodes slowly);
- the time it costs the others: a prefill stalls the worker's decoding requests, and the ones
  that arrive meanwhile (the worker's arrival rate), for as long as it computes; one more
  sequence slows each of the worker's decoding requests by the step's cost per sequence.
Step costs are what each worker learned from its own steps (pdserve/worker/step_costs.py); a worker
that
has not run such a step yet is priced like the others of the cluster, or by DEFAULT_COSTS.
Prompts below --disaggregate-min-tokens never take the disaggregated path (a floor: their KV
is not worth a transfer). `--route-policy length` disaggregates every prompt of at least
--disaggregate-min-tokens tokens when a prefill worker exists, and prefills the others locally.
A request may force its path with the x-pdserve-route header.
"""

from dataclasses import asdict, dataclass

from pdserve.settings.router import ESTIMATE, LENGTH
from router.errors import OpenAIError, invalid_request
from router.worker_client import WorkerClient

ROUTE_HEADER = "x-pdserve-route"
LOCAL, DISAGGREGATED, STAY_ON_PREFILL = "local", "disaggregated", "stay-on-prefill"
ROUTES = (LOCAL, DISAGGREGATED, STAY_ON_PREFILL)
MAX_EXPECTED_OUTPUT_TOKENS = 256  # a request's max_tokens is a bound, rarely all used
MAX_PREFILL_SHARE = 0.9  # a worker past this share of its time prefilling is taken as at it


@dataclass(frozen=True)
class StepCosts:
    prefill_s_per_token: float
    step_base_s: float
    step_per_sequence_s: float


# SmolLM2-135M on one core of this CPU machine; replaced by each worker's own figures as soon
# as it has run a prefill and a few decode steps.
DEFAULT_COSTS = StepCosts(prefill_s_per_token=0.003, step_base_s=0.04, step_per_sequence_s=0.004)


@dataclass(frozen=True)
class WorkerState:
    """What the estimate knows of one worker: its last Stats plus what this router sent since."""

    queued_tokens: int  # prompt tokens it has yet to compute
    decoding: int  # requests past their first token
    arrival_rate: float  # requests per second this router sends it
    prompt_token_rate: float  # prompt tokens per second this router sends it
    costs: StepCosts
    cached_tokens: int = 0  # of this request's prompt, likely in its prefix cache

    @classmethod
    def of(cls, worker: WorkerClient, cluster: StepCosts, cached_tokens: int = 0) -> "WorkerState":
        load = worker.load
        report = load.report
        rates = load.arrival_rates()
        if report is None:
            return cls(load.prompt_tokens_since, 0, *rates, cluster, cached_tokens)
        learned = StepCosts(
            report.prefill_seconds_per_token or cluster.prefill_s_per_token,
            report.decode_step_base_seconds or cluster.step_base_s,
            report.decode_step_seconds_per_sequence or cluster.step_per_sequence_s,
        )
        return cls(
            report.outstanding_prefill_tokens + load.prompt_tokens_since,
            max(0, report.running_requests - report.prefilling_requests),
            *rates,
            learned,
            cached_tokens,
        )

    def step_s(self, batch: int) -> float:
        return self.costs.step_base_s + self.costs.step_per_sequence_s * batch

    def prefill_share(self) -> float:
        """The share of its time the worker spends on the prompts it is sent."""
        return min(self.prompt_token_rate * self.costs.prefill_s_per_token, MAX_PREFILL_SHARE)

    def stall_cost_s(self, prefill_s: float) -> float:
        """Seconds lost by the others while this worker computes a prompt for `prefill_s`: its
        decoding requests wait that long, and the ones arriving meanwhile half as long."""
        return prefill_s * (self.decoding + self.arrival_rate * prefill_s / 2)


def cluster_costs(workers: list[WorkerClient]) -> StepCosts:
    """The mean of what the workers learned, field by field; DEFAULT_COSTS where none has."""

    def mean(field: str, default: float) -> float:
        values = [getattr(w.load.report, field) for w in workers if w.load.report is not None]
        values = [v for v in values if v > 0]
        return sum(values) / len(values) if values else default

    return StepCosts(
        mean("prefill_seconds_per_token", DEFAULT_COSTS.prefill_s_per_token),
        mean("decode_step_base_seconds", DEFAULT_COSTS.step_base_s),
        mean("decode_step_seconds_per_sequence", DEFAULT_COSTS.step_per_sequence_s),
    )


@dataclass(frozen=True)
class PathCost:
    route: str
    ttft_s: float  # the request's own time to its first token
    decode_s: float  # its own time from its first token to its last
    others_s: float  # what it costs the other requests on the workers it uses

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s + self.others_s


@dataclass(frozen=True)
class RouteDecision:
    route: str
    reason: str  # estimate, length, below_floor, header, no_prefill_worker, prefill_lost
    costs: tuple[PathCost, ...] = ()  # the estimate's prices, cheapest first

    def view(self) -> dict:
        """For the timing breakdown and the logs."""
        view = {"route": self.route, "reason": self.reason}
        if self.costs:
            view["costs"] = {
                cost.route: {k: round(v, 4) for k, v in asdict(cost).items() if k != "route"}
                | {"total_s": round(cost.total_s, 4)}
                for cost in self.costs
            }
        return view


def forced_route(header: str | None, have_prefill_workers: bool) -> str | None:
    """The path the x-pdserve-route header asks for (None without one): a 400 for an unknown
    path, a 503 for a path that needs a prefill worker when none is up."""
    if not header:
        return None
    if header not in ROUTES:
        raise invalid_request(
            f"{ROUTE_HEADER} must be one of {', '.join(ROUTES)}, not {header!r}",
            param=ROUTE_HEADER,
        )
    if header != LOCAL and not have_prefill_workers:
        raise OpenAIError(
            503,
            f"no prefill worker is available for a {header} request",
            "worker_unavailable",
            type="service_unavailable_error",
            code="worker_unavailable",
        )
    return header


def by_length(prompt_tokens: int, floor: int) -> RouteDecision:
    if prompt_tokens >= floor:
        return RouteDecision(DISAGGREGATED, LENGTH)
    return RouteDecision(LOCAL, "below_floor")


def estimate(
    prompt_tokens: int,
    max_tokens: int,
    decode: WorkerState,
    prefill: WorkerState,
    floor: int,
    decode_full: bool = False,
) -> RouteDecision:
    """The cheapest path for a request whose decode worker and prefill worker are chosen
    (stay-on-prefill only when `decode_full`); ties go to the path that moves no KV and uses the
    decode pool (local first)."""
    decode_steps = max(0, min(max_tokens, MAX_EXPECTED_OUTPUT_TOKENS) - 1)

    def decode_costs(worker: WorkerState) -> tuple[float, float]:
        own = decode_steps * worker.step_s(worker.decoding + 1) / (1 - worker.prefill_share())
        others = decode_steps * worker.costs.step_per_sequence_s * worker.decoding
        return own, others

    def prefill_times(worker: WorkerState) -> tuple[float, float]:
        queued = worker.queued_tokens * worker.costs.prefill_s_per_token
        own = max(1, prompt_tokens - worker.cached_tokens) * worker.costs.prefill_s_per_token
        return queued + own, worker.stall_cost_s(own)

    costs = []
    for route, prefills_on, decodes_on in (
        (LOCAL, decode, decode),
        (DISAGGREGATED, prefill, decode),
        (STAY_ON_PREFILL, prefill, prefill),
    ):
        if (route == DISAGGREGATED and prompt_tokens < floor) or (
            route == STAY_ON_PREFILL and not decode_full
        ):
            continue
        ttft, stall = prefill_times(prefills_on)
        own_decode, slowdown = decode_costs(decodes_on)
        costs.append(PathCost(route, ttft, own_decode, stall + slowdown))
    costs.sort(key=lambda cost: cost.total_s)  # stable: ties keep the order above
    return RouteDecision(costs[0].route, ESTIMATE, tuple(costs))
