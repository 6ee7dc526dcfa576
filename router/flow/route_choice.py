"""Which path a request takes (`--route-policy`): the router's side of the choice.

`estimate` (the default) prices every path from the workers' live state and takes the cheapest
(pdserve/costs/path_prices.py: the same function the planner's simulator asks). The figures are
each worker's last Stats plus what this router sent it since: step costs it learned from its own
steps (pdserve/worker/step_costs.py), or, for a worker that has run no such step yet, the mean of
the others' (DEFAULT_COSTS when none has). `length` disaggregates every prompt of at least
--disaggregate-min-tokens tokens when a prefill worker exists, and prefills the others locally.
A request may force its path with the x-pdserve-route header.

`choose` makes one attempt's whole choice (decode worker, path, prefill worker, pool fetch) from
the run's PromptView, with no I/O and no await: the retry loop (router/flow/retries.py) sends
what it returns, and counts it.
"""

from dataclasses import dataclass

from pdserve.core.kinds import Role, RoutePath, RouteReason
from pdserve.costs.path_prices import RouteDecision, WorkerState, by_length, estimate
from pdserve.costs.step_costs import DEFAULT_COSTS, StepCosts
from pdserve.protocol import worker_pb2
from pdserve.settings.router import LENGTH, RouterSettings
from router.http.errors import OpenAIError, invalid_request, worker_unavailable
from router.workers.choice import WorkerChoice
from router.workers.handle import WorkerHandle
from router.workers.pool import TAKES_REQUESTS
from router.workers.prompt_view import PromptView

ROUTE_HEADER = "x-pdserve-route"


@dataclass(frozen=True)
class Attempt:
    """One attempt's choice: who serves it, on which path and why, and what its computing
    worker fetches first."""

    decode: WorkerHandle  # takes the request (local, stay-on-prefill) or its decode leg
    prefill: WorkerHandle | None  # the prefill leg's worker: on the disaggregated path only
    decision: RouteDecision
    fetch: worker_pb2.PoolFetch | None = None  # for the worker that computes the prompt
    # Why no prefill worker could be paired with `decode` (the path fell back to local), if so.
    unpaired: str | None = None

    @property
    def route(self) -> RoutePath:
        return self.decision.route


@dataclass(frozen=True)
class Tried:
    """Workers an earlier attempt of the run found unavailable, by address."""

    decode: frozenset[str] = frozenset()
    prefill: frozenset[str] = frozenset()


def choose(
    choice: WorkerChoice,
    view: PromptView,
    settings: RouterSettings,
    sampling: worker_pb2.SamplingParams,
    forced: RouteDecision | None = None,
    tried: Tried = Tried(),
) -> Attempt:
    """The attempt's decode worker, then its path given that worker (`forced`, when the header
    or a lost prefill pool fixed it), the prefill worker when the path uses one (only one whose
    KV `decode` can take; with none the path is local), and the pool fetch of the worker that
    computes the prompt (none for a request that asks for its prompt's logprobs: vLLM computes
    its whole prompt, reading no cached KV). A 503 when no decode worker is left to try."""
    decode = choice.pick(TAKES_REQUESTS, view, tried.decode)
    floor = settings.disaggregate_min_tokens
    decision, prefill, unpaired = forced, None, None
    prefills = [w for w in choice.pool.live((Role.PREFILL,)) if w.address not in tried.prefill]
    if decision is None and not prefills:
        decision = RouteDecision(RoutePath.LOCAL, RouteReason.NO_PREFILL_WORKER)
    elif decision is None and settings.route_policy == LENGTH:
        decision = by_length(len(view.tokens), floor)
    if decision is None or decision.route != RoutePath.LOCAL:
        try:
            prefill = choice.pick((Role.PREFILL,), view, tried.prefill, pairs_with=decode)
        except OpenAIError as error:
            unpaired = error.message
            decision = RouteDecision(RoutePath.LOCAL, RouteReason.NO_PREFILL_WORKER)
    if decision is None:
        cluster = cluster_costs(choice.pool.live((Role.PREFILL, *TAKES_REQUESTS)))
        decision = estimate(
            len(view.tokens),
            sampling.max_tokens * max(1, sampling.n),
            worker_state(decode, cluster, choice.reusable_tokens(decode, view)),
            worker_state(prefill, cluster, choice.reusable_tokens(prefill, view)),
            floor,
            decode_full=decode.load.full(decode.identity.max_num_seqs),
        )
    if decision.route == RoutePath.LOCAL:
        prefill = None
    elif decision.route == RoutePath.STAY_ON_PREFILL:  # the prefill worker takes it whole
        decode, prefill = prefill, None
    computing = prefill or decode
    fetch = None if sampling.HasField("prompt_logprobs") else choice.pool_fetch(computing, view)
    return Attempt(decode, prefill, decision, fetch, unpaired)


def worker_state(worker: WorkerHandle, cluster: StepCosts, cached_tokens: int = 0) -> WorkerState:
    """What the estimate knows of `worker`: its last Stats plus what this router sent it since;
    `cluster`'s figures for those it has not learned yet."""
    load = worker.load
    report = load.report
    rates = load.arrival_rates()
    if report is None:
        return WorkerState(load.prompt_tokens_since, 0, *rates, cluster, cached_tokens)
    learned = StepCosts(
        prefill_s_per_token=report.prefill_seconds_per_token or cluster.prefill_s_per_token,
        decode_base_s=report.decode_step_base_seconds or cluster.decode_base_s,
        decode_s_per_sequence=(
            report.decode_step_seconds_per_sequence or cluster.decode_s_per_sequence
        ),
    )
    return WorkerState(
        report.outstanding_prefill_tokens + load.prompt_tokens_since,
        max(0, report.running_requests - report.prefilling_requests),
        *rates,
        learned,
        cached_tokens,
    )


def cluster_costs(workers: list[WorkerHandle]) -> StepCosts:
    """The mean of what the workers learned, field by field; DEFAULT_COSTS where none has."""

    def mean(field: str, default: float) -> float:
        values = [getattr(w.load.report, field) for w in workers if w.load.report is not None]
        values = [v for v in values if v > 0]
        return sum(values) / len(values) if values else default

    return StepCosts(
        prefill_s_per_token=mean("prefill_seconds_per_token", DEFAULT_COSTS.prefill_s_per_token),
        decode_base_s=mean("decode_step_base_seconds", DEFAULT_COSTS.decode_base_s),
        decode_s_per_sequence=mean(
            "decode_step_seconds_per_sequence", DEFAULT_COSTS.decode_s_per_sequence
        ),
    )


def forced_route(header: str | None, have_prefill_workers: bool) -> RoutePath | None:
    """The path the x-pdserve-route header asks for (None without one): a 400 for an unknown
    path, a 503 for a path that needs a prefill worker when none is up."""
    if not header:
        return None
    if header not in tuple(RoutePath):
        raise invalid_request(
            f"{ROUTE_HEADER} must be one of {', '.join(RoutePath)}, not {header!r}",
            param=ROUTE_HEADER,
        )
    if header != RoutePath.LOCAL and not have_prefill_workers:
        raise worker_unavailable(f"no prefill worker is available for a {header} request")
    return RoutePath(header)
