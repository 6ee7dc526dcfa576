"""A decode worker's finished KV transfers, carried by vLLM's connector stats.

The worker half returns its ranks' TransferReports each engine step
(kv_transfer/transfer_report.py); vLLM pickles them to its engine-core process, aggregates the
ranks' and sends `to_dict()`'s plain data on to the stat logger in the worker's AsyncLLM
process (pdserve/worker/engine_stats.py decodes it there).
"""

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kv_transfer.transfer_report import TRANSFERS, TransferReport


class PdserveKvStats(KVConnectorStats):
    """`data[TRANSFERS]`: TransferReports here, their `to_data()` once vLLM asks for plain data."""

    def __post_init__(self):
        self.data.setdefault(TRANSFERS, [])

    def reset(self):
        self.data = {TRANSFERS: []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data[TRANSFERS] = self.data[TRANSFERS] + other.data.get(TRANSFERS, [])
        return self

    def reports(self) -> list[TransferReport]:
        return self.data[TRANSFERS]

    def to_dict(self) -> dict:
        return {TRANSFERS: [report.to_data() for report in self.reports()]}

    def reduce(self) -> dict[str, int | float]:
        reports = self.reports()
        return {TRANSFERS: len(reports), "bytes": sum(report.bytes for report in reports)}

    def is_empty(self) -> bool:
        return not self.data[TRANSFERS]
