"""What each path would cost a request, priced from the live state of the workers it could use;
the router takes the cheapest (`--route-policy estimate`, router/flow/route_choice.py), and the
planner's simulator asks the same function, so a plan models the router that runs.

Three paths, none best everywhere:
- local: its decode worker prefills the prompt itself; no KV moves;
- disaggregated: a prefill worker computes the prompt and pushes its KV to the decode worker;
- stay-on-prefill: the prefill worker computes the prompt and decodes it too (what Dynamo calls
  prefill-continues-decode); no KV moves. Only priced when the decode worker is full (it runs
  as many requests as its engine takes at once): measured here, letting requests stay whenever
  the estimate favoured it filled the prefill worker with decoding requests, which every later
  long prompt then stalled (SLO attainment at 1.5 req/s on the mixed workload: 75% against 92%
  without).

Each path is priced in seconds, summed over every request it touches:
- the request's own time: to its first token (the prompt tokens queued on the worker that
  prefills, then its own less those likely in that worker's prefix cache, at that worker's cost
  per token) and to its last (its expected output tokens at the decode step its worker will run,
  one sequence more than now, stretched by the share of that worker's time its arriving prompts
  take: a worker that prefills most of the time decodes slowly);
- the time it costs the others: a prefill stalls the worker's decoding requests, and the ones
  that arrive meanwhile (the worker's arrival rate), for as long as it computes; one more
  sequence slows each of the worker's decoding requests by the step's cost per sequence.
Prompts below the floor (--disaggregate-min-tokens) never take the disaggregated path: their KV
is not worth a transfer.
"""

from collections import deque
from dataclasses import asdict, dataclass, field

from pdserve.core.kinds import RoutePath, RouteReason
from pdserve.costs.step_costs import StepCosts

MAX_EXPECTED_OUTPUT_TOKENS = 256  # a request's max_tokens is a bound, rarely all used
MAX_PREFILL_SHARE = 0.9  # a worker past this share of its time prefilling is taken as at it
RATE_WINDOW_S = 30.0  # a worker's arrival rates count what it was sent this long ago at most


@dataclass
class Arrivals:
    """What a worker was sent over the last RATE_WINDOW_S, as rates; times are whatever clock
    the caller keeps (the router's monotonic seconds, the simulator's)."""

    sent_at: deque = field(default_factory=deque)  # (time, prompt tokens) per send
    tokens: int = 0  # the prompt tokens of `sent_at`

    def sent(self, now: float, prompt_tokens: int) -> None:
        self.sent_at.append((now, prompt_tokens))
        self.tokens += prompt_tokens

    def rates(self, now: float) -> tuple[float, float]:
        """Requests and prompt tokens per second."""
        while self.sent_at and self.sent_at[0][0] < now - RATE_WINDOW_S:
            self.tokens -= self.sent_at.popleft()[1]
        return len(self.sent_at) / RATE_WINDOW_S, self.tokens / RATE_WINDOW_S


@dataclass(frozen=True)
class WorkerState:
    """What the estimate knows of one worker: its queue, its batch, its arrivals, its costs."""

    queued_tokens: int  # prompt tokens it has yet to compute
    decoding: int  # requests past their first token
    arrival_rate: float  # requests per second it is sent
    prompt_token_rate: float  # prompt tokens per second it is sent
    costs: StepCosts
    cached_tokens: int = 0  # of this request's prompt, likely in its prefix cache

    def prefill_share(self) -> float:
        """The share of its time the worker spends on the prompts it is sent."""
        return min(self.prompt_token_rate * self.costs.prefill_s_per_token, MAX_PREFILL_SHARE)

    def stall_cost_s(self, prefill_s: float) -> float:
        """Seconds lost by the others while this worker computes a prompt for `prefill_s`: its
        decoding requests wait that long, and the ones arriving meanwhile half as long."""
        return prefill_s * (self.decoding + self.arrival_rate * prefill_s / 2)


@dataclass(frozen=True)
class PathCost:
    route: RoutePath
    ttft_s: float  # the request's own time to its first token
    decode_s: float  # its own time from its first token to its last
    others_s: float  # what it costs the other requests on the workers it uses

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s + self.others_s


@dataclass(frozen=True)
class RouteDecision:
    route: RoutePath
    reason: RouteReason
    costs: tuple[PathCost, ...] = ()  # the estimate's prices, cheapest first

    def view(self) -> dict:
        """For the timing breakdown and the logs."""
        view = {"route": str(self.route), "reason": str(self.reason)}
        if self.costs:
            view["costs"] = {
                str(cost.route): {k: round(v, 4) for k, v in asdict(cost).items() if k != "route"}
                | {"total_s": round(cost.total_s, 4)}
                for cost in self.costs
            }
        return view


def by_length(prompt_tokens: int, floor: int) -> RouteDecision:
    """`--route-policy length`: every prompt of at least `floor` tokens is disaggregated."""
    if prompt_tokens >= floor:
        return RouteDecision(RoutePath.DISAGGREGATED, RouteReason.LENGTH)
    return RouteDecision(RoutePath.LOCAL, RouteReason.BELOW_FLOOR)


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
        step = worker.costs.decode_step_s(worker.decoding + 1)
        own = decode_steps * step / (1 - worker.prefill_share())
        others = decode_steps * worker.costs.decode_s_per_sequence * worker.decoding
        return own, others

    def prefill_times(worker: WorkerState) -> tuple[float, float]:
        queued = worker.costs.prefill_s(worker.queued_tokens)
        own = worker.costs.prefill_s(max(1, prompt_tokens - worker.cached_tokens))
        return queued + own, worker.stall_cost_s(own)

    costs = []
    for route, prefills_on, decodes_on in (
        (RoutePath.LOCAL, decode, decode),
        (RoutePath.DISAGGREGATED, prefill, decode),
        (RoutePath.STAY_ON_PREFILL, prefill, prefill),
    ):
        if (route == RoutePath.DISAGGREGATED and prompt_tokens < floor) or (
            route == RoutePath.STAY_ON_PREFILL and not decode_full
        ):
            continue
        ttft, stall = prefill_times(prefills_on)
        own_decode, slowdown = decode_costs(decodes_on)
        costs.append(PathCost(route, ttft, own_decode, stall + slowdown))
    costs.sort(key=lambda cost: cost.total_s)  # stable: ties keep the order above
    return RouteDecision(costs[0].route, RouteReason.ESTIMATE, tuple(costs))
