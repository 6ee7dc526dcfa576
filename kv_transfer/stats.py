"""Per-transfer figures from the decode worker's connector, carried by vLLM's stats path.

The worker half returns these each engine step; vLLM merges them into its scheduler stats,
which reach the stat logger in the worker's AsyncLLM process (see pdserve/worker/engine.py).
Each entry: {"transfer_id", "bytes", "seconds" (first slice received -> last slice received),
"failed", "failure" (why: timeout, cancelled, refused, integrity, not_held), "integrity" (the
kv_transfer/integrity.Damage that failed it, or ""), "transport"}. A tensor-parallel decode
worker's ranks each report their own part of a transfer (pdserve/worker/engine.py merges them).
"""

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


class PdserveKvStats(KVConnectorStats):
    def __post_init__(self):
        self.data.setdefault("transfers", [])

    def reset(self):
        self.data = {"transfers": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["transfers"] = self.data["transfers"] + other.data.get("transfers", [])
        return self

    def reduce(self) -> dict[str, int | float]:
        transfers = self.data["transfers"]
        return {"transfers": len(transfers), "bytes": sum(t["bytes"] for t in transfers)}

    def is_empty(self) -> bool:
        return not self.data["transfers"]
