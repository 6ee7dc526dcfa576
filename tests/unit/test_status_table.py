"""`pdserve status`'s table (pdserve/cluster/status.py): each worker's load and what a prompt
token's fetch from another host's KV pool, its load from its own and its compute take there
(from its registry record)."""

from dataclasses import asdict

from pdserve.cluster.status import _table
from pdserve.protocol.registry import RecordedLoad


def row(worker: str, load: RecordedLoad | None) -> dict:
    return {
        "worker": worker,
        "role": "prefill",
        "state": "in pool" if load else "replacing",
        "address": "10.0.0.1:50051" if load else "",
        "node": "node-1",
        "gpu_ids": ["0"],
        "pid": 7,
        "tensor_parallel_size": 1,
        "load": asdict(load) if load else None,
    }


def test_the_table_shows_each_workers_load_and_compute_per_token():
    measured = RecordedLoad(
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
        "workers": [row("prefill-0", measured), row("prefill-1", RecordedLoad()), row("p-2", None)],
        "kv_pools": [],
        "keeper": {"error": "no keeper"},
    }
    header, *rows = _table(report).splitlines()[1:5]
    assert header.endswith("µs/token fetch/load/compute")
    columns = {line.split()[0]: line.split() for line in rows}
    assert columns["prefill-0"][-2:] == ["0/10", "50/23/2200"]  # KV blocks, then µs per token
    assert columns["prefill-1"][-1] == "-/-/-"  # nothing measured yet
    assert columns["p-2"][-1] == "-"  # no record
