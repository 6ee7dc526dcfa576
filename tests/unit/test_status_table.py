"""`pdserve status`'s table (pdserve/cluster/status.py): each worker's load and what a prompt
token's fetch from another host's KV pool, its load from its own and its compute take there
(from its registry record)."""

import argparse
import json

from kv_transfer.pool.wire import PoolStats
from pdserve.cluster import ray_launcher, replica_keeper, status
from pdserve.cluster.cluster_state import ClusterState
from pdserve.cluster.ray_launcher import HostedProcess, kv_pool_actor
from pdserve.cluster.status import _table
from pdserve.protocol import worker_pb2
from pdserve.protocol.registry import WorkerRecord, load_figures


def row(worker: str, load: worker_pb2.StatsReply | None) -> dict:
    return {
        "worker": worker,
        "role": "prefill",
        "state": "in pool" if load else "replacing",
        "address": "10.0.0.1:50051" if load else "",
        "node": "node-1",
        "gpu_ids": ["0"],
        "pid": 7,
        "tensor_parallel_size": 1,
        "load": load_figures(load) if load else None,
    }


def test_the_table_shows_each_workers_load_and_compute_per_token():
    measured = worker_pb2.StatsReply(
        running_requests=2,
        kv_blocks_total=10,
        prefill_seconds_per_token=0.0022,
        kv_pool_load_seconds_per_token=0.000023,
        kv_pool_fetch_seconds_per_token=0.00005,
    )
    report = {
        "name": "c",
        "router": "http://r",
        "ray": "ray://x",
        "registry": "redis://y",
        "workers": [
            row("prefill-0", measured),
            row("prefill-1", worker_pb2.StatsReply()),
            row("p-2", None),
        ],
        "kv_pools": [],
        "keeper": {"error": "no keeper"},
    }
    header, *rows = _table(report).splitlines()[1:5]
    assert header.endswith("µs/token fetch/load/compute")
    columns = {line.split()[0]: line.split() for line in rows}
    assert columns["prefill-0"][-2:] == ["0/10", "50/23/2200"]  # KV blocks, then µs per token
    assert columns["prefill-1"][-1] == "-/-/-"  # nothing measured yet
    assert columns["p-2"][-1] == "-"  # no record


def test_status_reports_what_the_actors_the_registry_and_the_keeper_say(monkeypatch, capsys):
    """`pdserve status --json` from typed answers: a worker's actor (its process exited, so it
    is not in the pool), a node's KV pool with its store's figures, a registry record of a
    worker no actor of this cluster runs, and a keeper that does not answer."""
    state = ClusterState(
        name="c",
        config_path="/c.yaml",
        ray_address="127.0.0.1:1",
        namespace="pdserve-c",
        registry_url="redis://127.0.0.1:1/0",
        router_url="http://r",
        log_dir="/logs",
    )
    pool = kv_pool_actor("node-1abcdef0", "1")
    processes = {
        "prefill-0": HostedProcess(pid=7, node="node-1", log="/logs/p0.log", exit_code=1),
        pool: HostedProcess(pid=8, node="node-1", log="/logs/pool.log", address="@pool"),
    }
    stats = PoolStats("ns", 2**30, 8, 3, 4096, 12288, 5, 0, 0)
    theirs = WorkerRecord(
        worker_pb2.HealthReply(worker_id="decode-9", role="decode", tensor_parallel_size=2),
        address="10.0.0.9:50051",
        node="node-9",
    )

    def keeper_gone():
        raise RuntimeError("no replica-keeper actor")

    monkeypatch.setattr(status, "target_state", lambda args: state)
    monkeypatch.setattr(ray_launcher, "connect", lambda *args: None)
    monkeypatch.setattr(ray_launcher, "actor_names", lambda cluster: sorted(processes))
    monkeypatch.setattr(ray_launcher, "describe", processes.__getitem__)
    monkeypatch.setattr(ray_launcher, "kv_pool_stats", {pool: stats}.get)
    monkeypatch.setattr(replica_keeper, "report", keeper_gone)
    monkeypatch.setattr(status, "read_members", lambda url, cluster: [theirs])
    assert status.run(argparse.Namespace(json=True)) == 0
    report = json.loads(capsys.readouterr().out)
    ours, not_ours = report["workers"]
    assert ours["worker"] == "prefill-0" and ours["state"] == "exited" and ours["pid"] == 7
    assert not_ours["worker"] == "decode-9" and not_ours["state"] == "in pool, not ours"
    assert not_ours["tensor_parallel_size"] == 2 and not_ours["address"] == "10.0.0.9:50051"
    (described,) = report["kv_pools"]
    assert described["address"] == "@pool" and described["exit_code"] is None
    assert described["stats"]["used"] == 3
    assert report["keeper"] == {"error": "no replica-keeper actor"}
    assert "KV pool on node node-1" in status._table(report)
