"""What a worker keeps of its engine's KV transfer reports (pdserve/worker/engine_stats.py's
EngineStats): a tensor-parallel decode worker's ranks each report their part of a transfer, and
the transfer counts once, its ranks' figures merged, when the last rank has reported; and the
host KV pool's load time per token, from vLLM's offloading connector's stats."""

from dataclasses import fields

import msgspec

from kv_transfer.integrity import Damage
from kv_transfer.transfer_report import TRANSFERS, Failure, TransferReport
from pdserve.worker.engine_stats import (
    POOL_LOAD_TIME,
    EngineStats,
    kv_transfers,
    pool_load_seconds,
    pool_loaded_tokens,
)


def report(transfer_id: str, size: int, seconds: float, failure=None, transport="shm"):
    return TransferReport(
        transfer_id, size, seconds, failure, transports=frozenset({transport} - {""})
    )


def test_a_transfer_counts_once_every_rank_reported_it_with_their_figures_merged():
    stats = EngineStats()
    stats.ranks = 2
    assert stats.kv_transfer_reported(report("t", 100, 0.2)) is None
    assert stats.take_kv_transfer("t") is None  # half of it: not the transfer's figures yet
    whole = stats.kv_transfer_reported(report("t", 100, 0.3, transport="grpc"))
    assert (whole.bytes, whole.seconds, whole.failed) == (200, 0.3, False)
    assert whole.transport == "grpc,shm"
    assert whole.pinned_bytes is None  # no rank pinned memory (CPU)
    assert stats.take_kv_transfer("t") == whole
    stats.kv_transfer_reported(TransferReport("p", 1, 0.1, pinned_bytes=1 << 30))
    pinned = stats.kv_transfer_reported(TransferReport("p", 1, 0.1, pinned_bytes=1 << 30))
    assert pinned.pinned_bytes == 2 << 30  # each CUDA rank's receive arena
    stats.kv_transfer_reported(TransferReport("s", 1, 0.1, in_step=True))
    assert stats.kv_transfer_reported(TransferReport("s", 1, 0.1, in_step=True)).in_step
    stats.kv_transfer_reported(TransferReport("a", 1, 0.1, in_step=True))
    assert not stats.kv_transfer_reported(TransferReport("a", 1, 0.1)).in_step  # every rank, or not


def test_one_failed_rank_fails_the_transfer_and_one_rank_engines_report_at_once():
    stats = EngineStats()
    stats.ranks = 2
    stats.kv_transfer_reported(report("t", 0, 1.0, failure=Failure.TIMEOUT, transport=""))
    whole = stats.kv_transfer_reported(report("t", 50, 0.5))
    assert (whole.failed, whole.failure, whole.bytes) == (True, Failure.TIMEOUT, 50)
    single = EngineStats()
    assert single.kv_transfer_reported(report("u", 10, 0.1)) == report("u", 10, 0.1)


def test_a_report_survives_vllms_trip_to_the_stat_logger_with_every_field():
    """vLLM pickles the worker's stats to its engine core, which sends `to_dict()` on through
    msgspec: the stat logger decodes the same reports, every field set or unset."""
    from kv_transfer.stats import PdserveKvStats  # vLLM's: paid here, not at every collection

    full = TransferReport(
        "t", 7, 0.5, Failure.INTEGRITY, Damage.DIGEST, frozenset({"grpc", "shm"}), 1 << 20, True
    )
    empty = TransferReport("u")
    assert all(getattr(full, f.name) != getattr(empty, f.name) for f in fields(TransferReport))
    stats = PdserveKvStats(data={TRANSFERS: [full]}).aggregate(
        PdserveKvStats(data={TRANSFERS: [empty]})
    )
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode({"DecodeConnector": stats.to_dict()}))
    assert kv_transfers(wire) == [full, empty]
    assert isinstance(kv_transfers(wire)[0].failure, Failure)


def test_the_pool_load_time_is_read_from_the_offloading_connectors_stats_alone_or_among_several():
    """vLLM's offloading connector (the host KV pool's) reports its own stats on a colocated
    worker and one connector's among a MultiConnector's on a prefill worker; its load-time
    counter is summed over its labels, other series and connectors ignored."""
    own = {
        "types": {POOL_LOAD_TIME: "counter", "vllm:kv_offload_store_time": "counter"},
        "data": {POOL_LOAD_TIME: {(): 0.25, ("x",): 0.5}, "vllm:kv_offload_store_time": {(): 9}},
    }
    assert pool_load_seconds(own) == 0.75
    assert pool_load_seconds({"PdserveConnector": {"transfers": []}, "Offloading": own}) == 0.75
    assert pool_load_seconds(None) == pool_load_seconds({"transfers": []}) == 0.0


def test_a_decode_workers_transfers_are_read_from_its_connector_alone_or_beside_the_pools():
    """A decode worker in a KV pool runs pdserve's consumer and the pool's connector in vLLM's
    MultiConnector, whose report nests each connector's: the transfers are found either way
    (read only at the top, the decode leg and /metrics lost every pooled decode worker's)."""
    sent = [TransferReport("a", 7), TransferReport("b", 9, failure=Failure.NOT_HELD)]
    data = [report.to_data() for report in sent]
    pool = {"types": {POOL_LOAD_TIME: "counter"}, "data": {POOL_LOAD_TIME: {(): 0.5}}}
    assert kv_transfers({TRANSFERS: data}) == sent
    assert kv_transfers({"DecodeConnector": {TRANSFERS: data}, "PoolConnector": pool}) == sent
    assert kv_transfers(pool) == kv_transfers(None) == []


def test_load_time_per_token_counts_the_ranks_loading_side_by_side():
    stats = EngineStats()
    assert stats.pool_load_seconds_per_token() == 0.0  # nothing loaded yet
    stats.ranks, stats.pool_load_seconds, stats.pool_loaded_tokens = 2, 0.4, 1000
    assert stats.pool_load_seconds_per_token() == 0.0002  # each rank loaded its part for 0.2 s


def test_the_pools_loaded_tokens_leave_out_what_a_prefill_worker_sent():
    """vLLM counts every token its connectors loaded; a pooled decode worker's include the KV
    its prefill workers sent (source "p2p", kv_transfer/connector_base.py), which are no pool
    hits; a preempted request's (counted apart, with no source) are the pool's."""
    # vLLM is imported where a test runs, not where every test process collects this file
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import PrefixCacheStats

    hits = PrefixCacheStats()
    sources = {CacheHitSource.P2P: 512, CacheHitSource.HOST: 128}
    hits.record(num_tokens=900, num_hits=640, preempted=False, hits_by_source=sources)
    hits.record(num_tokens=300, num_hits=256, preempted=False, hits_by_source={"host": 256})
    hits.record(num_tokens=200, num_hits=128, preempted=True)
    assert pool_loaded_tokens(hits) == 128 + 256 + 128
    assert pool_loaded_tokens(None) == pool_loaded_tokens(PrefixCacheStats()) == 0
    assert CacheHitSource.P2P == "p2p"  # the name the stats carry across processes
