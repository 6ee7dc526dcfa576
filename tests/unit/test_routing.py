"""Routing decisions and pool policies, with fake workers (no engine needed)."""

import pytest

from router.disaggregation import DISAGGREGATED, LOCAL, choose_route
from router.errors import OpenAIError
from router.policies import LeastLoaded, RoundRobin


class FakeWorker:
    """Stands in for a WorkerClient: policies only read `role` and `outstanding_tokens`."""

    def __init__(self, name: str, outstanding_tokens: int = 0, role: str = "decode") -> None:
        self.name = name
        self.outstanding_tokens = outstanding_tokens
        self.role = role


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


def test_least_loaded_picks_the_fewest_outstanding_tokens():
    workers = [FakeWorker("a", 900), FakeWorker("b", 20), FakeWorker("c", 300)]
    assert LeastLoaded().choose(workers).name == "b"
