"""Routing decisions and pool policies, with fake workers (no engine needed)."""

import pytest

from router.disaggregation import DISAGGREGATED, LOCAL, choose_route
from router.errors import OpenAIError
from router.policies import LeastLoaded, RoundRobin
from router.worker_load import WorkerLoad
from worker.protocol import worker_pb2


class FakeWorker:
    """Stands in for a WorkerClient: policies only read `role` and `load`, here the worker's
    report (a StatsReply's fields) and nothing sent since."""

    def __init__(self, name: str, role: str = "decode", **report) -> None:
        self.name = name
        self.role = role
        self.load = WorkerLoad(worker_pb2.StatsReply(**report))


@pytest.mark.parametrize(
    "prompt_tokens, have_prefill, expected",
    [
        (10, True, LOCAL),
        (255, True, LOCAL),
        (256, True, DISAGGREGATED),
        (5000, True, DISAGGREGATED),
        (5000, False, LOCAL),
    ],
)
def test_the_threshold_decides_the_path(prompt_tokens, have_prefill, expected):
    assert choose_route(None, prompt_tokens, 256, have_prefill) == expected


def test_the_header_forces_the_path():
    assert choose_route("disaggregated", 3, 256, True) == DISAGGREGATED
    assert choose_route("local", 9000, 256, True) == LOCAL


def test_forcing_disaggregation_without_prefill_workers_is_a_503():
    with pytest.raises(OpenAIError) as caught:
        choose_route("disaggregated", 3, 256, False)
    assert caught.value.status == 503


def test_round_robin_cycles_through_the_candidates():
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    policy = RoundRobin()
    assert [policy.choose(workers).name for _ in range(4)] == ["a", "b", "c", "a"]


def test_round_robin_takes_turns_within_each_pool():
    """Each disaggregated request picks a prefill worker, then a decode worker: both pools
    still take turns (one shared counter sent every prefill to the same worker of two)."""
    prefill = [FakeWorker("p0", role="prefill"), FakeWorker("p1", role="prefill")]
    decode = [FakeWorker("d0"), FakeWorker("d1")]
    policy = RoundRobin()
    picks = [(policy.choose(prefill).name, policy.choose(decode).name) for _ in range(4)]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_least_loaded_sends_a_prompt_to_the_prefill_worker_with_the_least_left_to_compute():
    workers = [
        FakeWorker(name, "prefill", outstanding_prefill_tokens=tokens)
        for name, tokens in (("a", 900), ("b", 20), ("c", 300))
    ]
    assert LeastLoaded().choose(workers).name == "b"


def test_least_loaded_decode_goes_by_requests_then_kv_blocks_in_use():
    workers = [
        FakeWorker("busy", running_requests=5, kv_blocks_used=10, kv_blocks_total=100),
        FakeWorker("full", running_requests=2, kv_blocks_used=90, kv_blocks_total=100),
        FakeWorker("roomy", running_requests=2, kv_blocks_used=30, kv_blocks_total=100),
    ]
    assert LeastLoaded().choose(workers).name == "roomy"


def test_two_routers_reading_the_same_reports_agree():
    reports = [dict(running_requests=n, kv_blocks_total=100) for n in (3, 1, 2)]
    first = [FakeWorker(f"w{i}", **report) for i, report in enumerate(reports)]
    second = [FakeWorker(f"w{i}", **report) for i, report in enumerate(reports)]
    assert LeastLoaded().choose(first).name == LeastLoaded().choose(second).name == "w1"


def test_what_a_router_sent_since_the_report_counts_until_the_next_one():
    """A burst between two polls spreads out instead of piling onto the idlest-looking one."""
    workers = [FakeWorker("a", running_requests=1), FakeWorker("b", running_requests=2)]
    policy = LeastLoaded()
    picks = []
    for _ in range(4):
        worker = policy.choose(workers)
        worker.load.sent(prompt_tokens=10)
        picks.append(worker.name)
    assert picks == ["a", "a", "b", "a"]
    workers[0].load.reported(worker_pb2.StatsReply(running_requests=0))
    assert workers[0].load.requests_since == 0 and policy.choose(workers).name == "a"


def test_capacity_is_max_num_seqs_unless_the_engine_waits_for_kv_blocks():
    def load(**report) -> WorkerLoad:
        return WorkerLoad(worker_pb2.StatsReply(kv_blocks_total=100, **report))

    assert WorkerLoad().capacity(8) == 8  # no report yet
    assert load(running_requests=8, waiting_requests=2, kv_blocks_used=40).capacity(8) == 8
    # Blocks nearly all in use and requests held back: only what it runs now.
    assert load(running_requests=8, waiting_requests=3, kv_blocks_used=95).capacity(8) == 5
    assert load(running_requests=2, waiting_requests=2, kv_blocks_used=99).capacity(8) == 1
