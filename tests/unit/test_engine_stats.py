"""What a worker keeps of its engine's KV transfer reports (pdserve/worker/engine.py's
EngineStats): a tensor-parallel decode worker's ranks each report their part of a transfer, and
the transfer counts once, its ranks' figures merged, when the last rank has reported."""

from pdserve.worker.engine import EngineStats


def report(transfer_id: str, size: int, seconds: float, failure: str = "", transport="shm"):
    return {
        "transfer_id": transfer_id,
        "bytes": size,
        "seconds": seconds,
        "failed": bool(failure),
        "failure": failure,
        "integrity": "",
        "transport": transport,
    }


def test_a_transfer_counts_once_every_rank_reported_it_with_their_figures_merged():
    stats = EngineStats()
    stats.ranks = 2
    assert stats.kv_transfer_reported(report("t", 100, 0.2)) is None
    assert stats.take_kv_transfer("t") is None  # half of it: not the transfer's figures yet
    whole = stats.kv_transfer_reported(report("t", 100, 0.3, transport="gloo"))
    assert (whole["bytes"], whole["seconds"], whole["failed"]) == (200, 0.3, False)
    assert whole["transport"] == "gloo,shm"
    assert stats.take_kv_transfer("t") == whole


def test_one_failed_rank_fails_the_transfer_and_one_rank_engines_report_at_once():
    stats = EngineStats()
    stats.ranks = 2
    stats.kv_transfer_reported(report("t", 0, 1.0, failure="timeout", transport=""))
    whole = stats.kv_transfer_reported(report("t", 50, 0.5))
    assert (whole["failed"], whole["failure"], whole["bytes"]) == (True, "timeout", 50)
    single = EngineStats()
    assert single.kv_transfer_reported(report("u", 10, 0.1)) == report("u", 10, 0.1)
