"""What the replica keeper decides, without Ray: the crash-loop back-off of a worker slot, and
the slot a dead worker's name is started again in."""

import pytest

from pdserve.cluster.crash_loop import FIRST_S, MAX_S, STABLE_S, CrashLoopBackoff
from pdserve.cluster.placement import slot_named, worker_slots
from pdserve.settings.cluster_file import parse_cluster


def test_a_first_death_is_replaced_after_the_first_wait():
    backoff = CrashLoopBackoff(started_at=0.0)
    assert not backoff.due(10.0)  # seen dead now
    assert backoff.wait_left(10.0) == FIRST_S
    assert backoff.due(10.0 + FIRST_S)


def test_a_crash_loop_waits_twice_as_long_each_time_up_to_the_cap():
    backoff, now, waits = CrashLoopBackoff(started_at=0.0), 0.0, []
    for _ in range(10):
        now += 30.0  # each replacement dies while its engine loads
        assert not backoff.due(now)
        waits.append(backoff.wait_left(now))
        now += waits[-1]
        assert backoff.due(now)
        backoff.replaced(now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, MAX_S, MAX_S, MAX_S, MAX_S]


def test_a_worker_that_ran_long_enough_resets_the_back_off():
    backoff = CrashLoopBackoff(started_at=0.0, delay_s=MAX_S)
    backoff.due(STABLE_S + 1)
    assert backoff.wait_left(STABLE_S + 1) == FIRST_S


def test_a_worker_not_seen_dead_has_nothing_to_wait_for():
    backoff = CrashLoopBackoff(started_at=0.0)
    assert backoff.wait_left(5.0) == 0.0
    backoff.due(5.0)
    backoff.replaced(7.0)
    assert backoff.wait_left(8.0) == 0.0


def test_a_dead_worker_is_started_again_in_the_slot_of_its_name():
    config = parse_cluster(
        {
            "prefill": {"replicas": 2, "tensor_parallel_size": 2, "gpu_type": "H100-SXM"},
            "decode": {"replicas": 3},
        }
    )
    for slot in worker_slots(config):
        assert slot_named(config, slot.name) == slot
    assert slot_named(config, "decode-7").bundles == ({"CPU": 1.0},)
    for name in ("router", "decode", "decode-x", "flex-0"):
        with pytest.raises(ValueError):
            slot_named(config, name)
