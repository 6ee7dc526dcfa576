"""`pdserve serve`'s workers (pdserve/cluster/serve.py's plan): which of them use the KV pool,
and which share a store."""

import argparse

from pdserve.cluster import serve
from pdserve.settings.engine import EngineSettings
from pdserve.settings.worker import WorkerSettings


def plan(decode_kv_pool: str, kv_pool: str = "on") -> list[tuple[str, str]]:
    args = argparse.Namespace(
        colocated=False, flex=0, prefill=1, decode=2, prefill_tensor_parallel_size=None,
        decode_kv_pool=decode_kv_pool,
    )  # fmt: skip
    workers = serve._worker_plan(args, WorkerSettings(role="decode", kv_pool=kv_pool), [])
    return [(worker.role, worker.kv_pool) for worker in workers]


def test_decode_workers_join_the_pool_unless_kept_out():
    assert plan("on") == [("prefill", "on"), ("decode", "on"), ("decode", "on")]
    assert plan("off") == [("prefill", "on"), ("decode", "off"), ("decode", "off")]
    assert plan("on", kv_pool="off") == [("prefill", "off"), ("decode", "off"), ("decode", "off")]


def test_a_host_has_a_store_for_each_tensor_parallel_size(monkeypatch, tmp_path):
    """A store holds one layout of blocks (a part per rank): TP-2 prefill workers and a TP-1
    decode worker get one store each (a shared one refused whichever joined second)."""
    started = []

    def fake_store(log_path, budget_bytes):  # stands in for starting kv_transfer/pool/store.py
        started.append(log_path.name)
        return f"@pool-{len(started)}", object()

    monkeypatch.setattr(serve.local_services, "start_kv_pool", fake_store)
    two = EngineSettings(tensor_parallel_size=2)
    workers = [
        WorkerSettings(role="prefill", engine=two),
        WorkerSettings(role="prefill", engine=two),
        WorkerSettings(role="decode"),
        WorkerSettings(role="decode", kv_pool="off"),
    ]
    host = argparse.Namespace(kv_pool_gib=1.0, kv_pool_scope="host")
    pooled = serve._with_kv_pools(workers, host, tmp_path, [])
    assert [w.kv_pool_address for w in pooled] == ["@pool-1", "@pool-1", "@pool-2", ""]
    started.clear()
    each = argparse.Namespace(kv_pool_gib=1.0, kv_pool_scope="worker")
    pooled = serve._with_kv_pools(workers, each, tmp_path, [])
    assert [w.kv_pool_address for w in pooled] == ["@pool-1", "@pool-2", "@pool-3", ""]
