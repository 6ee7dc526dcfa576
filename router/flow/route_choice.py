"""Which path a request takes (`--route-policy`): the router's side of the choice.

`estimate` (the default) prices every path from the workers' live state and takes the cheapest
(pdserve/costs/path_prices.py: the same function the planner's simulator asks). The figures are
each worker's last Stats plus what this router sent it since: step costs it learned from its own
steps (pdserve/worker/step_costs.py), or, for a worker that has run no such step yet, the mean of
the others' (DEFAULT_COSTS when none has). `length` disaggregates every prompt of at least
--disaggregate-min-tokens tokens when a prefill worker exists, and prefills the others locally.
A request may force its path with the x-pdserve-route header.
"""

from pdserve.core.kinds import RoutePath
from pdserve.costs.path_prices import WorkerState
from pdserve.costs.step_costs import DEFAULT_COSTS, StepCosts
from router.http.errors import invalid_request, worker_unavailable
from router.workers.client import WorkerClient

ROUTE_HEADER = "x-pdserve-route"


def worker_state(worker: WorkerClient, cluster: StepCosts, cached_tokens: int = 0) -> WorkerState:
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


def cluster_costs(workers: list[WorkerClient]) -> StepCosts:
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
