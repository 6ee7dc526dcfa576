"""Routing decisions and pool policies, with fake workers (no engine needed)."""

import pytest

from pdserve.core.kinds import RoutePath
from pdserve.costs.path_prices import by_length
from pdserve.protocol import worker_pb2
from router.flow.route_choice import forced_route
from router.http.errors import OpenAIError
from router.workers.load import WorkerLoad
from router.workers.policies import LeastLoaded, RoundRobin
from tests.fakes import FakeWorker


def reporting(name: str, role: str = "decode", **report) -> FakeWorker:
    """A worker whose last Stats said `report` (a StatsReply's fields), nothing sent since."""
    worker = FakeWorker(name, role)
    worker.load = WorkerLoad(worker_pb2.StatsReply(**report))
    return worker


@pytest.mark.parametrize(
    "prompt_tokens, expected",
    [
        (10, RoutePath.LOCAL),
        (255, RoutePath.LOCAL),
        (256, RoutePath.DISAGGREGATED),
        (5000, RoutePath.DISAGGREGATED),
    ],
)
def test_the_length_policy_disaggregates_from_the_threshold_on(prompt_tokens, expected):
    assert by_length(prompt_tokens, 256).route == expected


def test_the_header_forces_the_path():
    assert forced_route(None, True) is None
    assert forced_route("disaggregated", True) == RoutePath.DISAGGREGATED
    assert forced_route("stay-on-prefill", True) == RoutePath.STAY_ON_PREFILL
    assert forced_route("local", False) == RoutePath.LOCAL


@pytest.mark.parametrize("route", [RoutePath.DISAGGREGATED, RoutePath.STAY_ON_PREFILL])
def test_forcing_a_path_through_a_prefill_worker_without_one_is_a_503(route):
    with pytest.raises(OpenAIError) as caught:
        forced_route(route, False)
    assert caught.value.status == 503


def test_an_unknown_path_is_a_400_naming_the_header():
    with pytest.raises(OpenAIError) as caught:
        forced_route("sideways", True)
    assert caught.value.status == 400 and caught.value.param == "x-pdserve-route"


def test_round_robin_cycles_through_the_candidates():
    workers = [reporting("a"), reporting("b"), reporting("c")]
    policy = RoundRobin()
    assert [policy.choose(workers).identity.worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_takes_turns_within_each_pool():
    """Each disaggregated request picks a prefill worker, then a decode worker: both pools
    still take turns (one shared counter sent every prefill to the same worker of two)."""
    prefill = [reporting("p0", role="prefill"), reporting("p1", role="prefill")]
    decode = [reporting("d0"), reporting("d1")]
    policy = RoundRobin()
    picks = [
        (policy.choose(prefill).identity.worker_id, policy.choose(decode).identity.worker_id)
        for _ in range(4)
    ]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_least_loaded_sends_a_prompt_to_the_prefill_worker_with_the_least_left_to_compute():
    workers = [
        reporting(name, "prefill", outstanding_prefill_tokens=tokens)
        for name, tokens in (("a", 900), ("b", 20), ("c", 300))
    ]
    assert LeastLoaded().choose(workers).identity.worker_id == "b"


def test_least_loaded_decode_goes_by_requests_then_kv_blocks_in_use():
    workers = [
        reporting("busy", running_requests=5, kv_blocks_used=10, kv_blocks_total=100),
        reporting("full", running_requests=2, kv_blocks_used=90, kv_blocks_total=100),
        reporting("roomy", running_requests=2, kv_blocks_used=30, kv_blocks_total=100),
    ]
    assert LeastLoaded().choose(workers).identity.worker_id == "roomy"


def test_two_routers_reading_the_same_reports_agree():
    reports = [dict(running_requests=n, kv_blocks_total=100) for n in (3, 1, 2)]
    first = [reporting(f"w{i}", **report) for i, report in enumerate(reports)]
    second = [reporting(f"w{i}", **report) for i, report in enumerate(reports)]
    assert (
        LeastLoaded().choose(first).identity.worker_id
        == LeastLoaded().choose(second).identity.worker_id
        == "w1"
    )


def test_what_a_router_sent_since_the_report_counts_until_the_next_one():
    """A burst between two polls spreads out instead of piling onto the idlest-looking one."""
    workers = [reporting("a", running_requests=1), reporting("b", running_requests=2)]
    policy = LeastLoaded()
    picks = []
    for _ in range(4):
        worker = policy.choose(workers)
        worker.load.sent(prompt_tokens=10)
        picks.append(worker.identity.worker_id)
    assert picks == ["a", "a", "b", "a"]
    workers[0].load.reported(worker_pb2.StatsReply(running_requests=0))
    assert workers[0].load.requests_since == 0 and policy.choose(workers).identity.worker_id == "a"


def test_capacity_is_max_num_seqs_unless_the_engine_waits_for_kv_blocks():
    def load(**report) -> WorkerLoad:
        return WorkerLoad(worker_pb2.StatsReply(kv_blocks_total=100, **report))

    assert WorkerLoad().capacity(8) == 8  # no report yet
    assert load(running_requests=8, waiting_requests=2, kv_blocks_used=40).capacity(8) == 8
    # Blocks nearly all in use and requests held back: only what it runs now.
    assert load(running_requests=8, waiting_requests=3, kv_blocks_used=95).capacity(8) == 5
    assert load(running_requests=2, waiting_requests=2, kv_blocks_used=99).capacity(8) == 1
