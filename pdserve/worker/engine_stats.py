"""What a worker keeps of its engine's stats, and the vLLM stat logger that keeps it.

vLLM reports scheduler stats after each engine step to the stat loggers in the worker's AsyncLLM
process: the scheduler's load (Health, Stats, the routers' estimates), the learned step costs,
the host KV pool's loads, and the KV transfers a decode connector finished
(kv_transfer/stats.py), which the worker's Prometheus metrics count and the request's last chunk
carries to the router (pdserve/worker/service.py).
"""

from kv_transfer.transfer_report import TRANSFERS, TransferReport
from pdserve.worker.step_costs import StepCostLearner

MAX_UNCLAIMED_TRANSFERS = 4096
POOL_LOAD_TIME = "vllm:kv_offload_load_time"  # vLLM's offloading connector's counter


class EngineStats:
    """The engine's latest scheduler report, kept by a vLLM stat logger.

    vLLM reports scheduler stats after each engine step, so an idle engine keeps its last
    report (a fresh Stats call runs a probe step first).
    """

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.engines: dict[int, tuple[int, int, float]] = {}  # each engine's last report
        self.ranks = 1  # the engine's tensor-parallel ranks, each reporting its part of a transfer
        self.kv_transfers: dict[str, TransferReport] = {}  # transfer id -> the whole transfer's
        self.partial: dict[str, tuple[int, TransferReport]] = {}  # ... reported by some ranks
        self.step_costs = StepCostLearner()
        self.pool_load_seconds = 0.0  # copying blocks in from the host KV pool, all ranks
        self.pool_loaded_tokens = 0  # prompt tokens loaded from it
        self.pool_fetch_seconds = 0.0  # fetching blocks from other hosts' pools into it
        self.pool_fetched_tokens = 0  # prompt tokens fetched so

    def pool_load_seconds_per_token(self) -> float:
        """What loading a prompt token from the host KV pool has taken here (0: none yet)."""
        if not self.pool_loaded_tokens:
            return 0.0
        return self.pool_load_seconds / self.ranks / self.pool_loaded_tokens

    def pool_fetch_seconds_per_token(self) -> float:
        """What fetching a prompt token from another host's pool has taken here (0: none yet;
        pdserve/worker/pool_peers.py)."""
        if not self.pool_fetched_tokens:
            return 0.0
        return self.pool_fetch_seconds / self.pool_fetched_tokens

    def take_kv_transfer(self, transfer_id: str) -> TransferReport | None:
        return self.kv_transfers.pop(transfer_id, None)

    def kv_transfer_reported(self, report: TransferReport) -> TransferReport | None:
        """One rank's report of a transfer; the whole transfer's, its ranks' merged, once every
        rank has reported it (else None)."""
        count, so_far = self.partial.pop(report.transfer_id, (0, None))
        whole = report if so_far is None else so_far.merged(report)
        if count + 1 < self.ranks:
            self.partial[report.transfer_id] = (count + 1, whole)
            _keep_newest(self.partial)  # a rank that never reported
            return None
        self.kv_transfers[report.transfer_id] = whole
        _keep_newest(self.kv_transfers)  # their requests were aborted
        return whole

    def update(self, running: int, waiting: int, kv_cache_usage: float, engine: int = 0) -> None:
        """One engine's report. A data-parallel worker has an engine per rank, each with its
        own scheduler and a KV cache of the same size: the worker's figures are their sums and
        their mean usage."""
        self.engines[engine] = (running, waiting, kv_cache_usage)
        reports = self.engines.values()
        self.running = sum(report[0] for report in reports)
        self.waiting = sum(report[1] for report in reports)
        self.kv_cache_usage = sum(report[2] for report in reports) / len(self.engines)


def _keep_newest(entries: dict) -> None:
    """The newest MAX_UNCLAIMED_TRANSFERS entries (the oldest are forgotten)."""
    while len(entries) > MAX_UNCLAIMED_TRANSFERS:
        entries.pop(next(iter(entries)))


def connector_reports(connector_stats: dict | None) -> list[dict]:
    """One report of an engine's connector stats, as each connector's: the engine's one
    connector's, or each of a MultiConnector's (a pooled prefill or decode worker's:
    {connector class name: its stats})."""
    if not connector_stats:
        return []
    return [connector_stats, *(v for v in connector_stats.values() if isinstance(v, dict))]


def pool_load_seconds(connector_stats: dict | None) -> float:
    """The seconds vLLM's offloading connector (the host KV pool's: {"types", "data"}) spent
    loading blocks, in one report of an engine's connector stats."""
    return sum(
        float(seconds)
        for part in connector_reports(connector_stats)
        if isinstance(part.get("data"), dict)
        for seconds in (part["data"].get(POOL_LOAD_TIME) or {}).values()
    )


def pool_loaded_tokens(connector_hits) -> int:
    """Of an engine step's prompt tokens loaded by its connectors (vLLM's PrefixCacheStats),
    those the host KV pool's connector loaded: all but those a prefill worker sent a decode
    worker (kv_transfer/connector_base.py names their source "p2p"), a preempted request's
    included (vLLM counts them apart, with no source: only the pool loads a request again,
    and the load time per token counts their loads)."""
    if connector_hits is None:
        return 0
    sent = connector_hits.hits_by_source.get("p2p", 0)
    return connector_hits.hits + connector_hits.preempted_hits - sent


def kv_transfers(connector_stats: dict | None) -> list[TransferReport]:
    """The KV transfers a decode worker's connector finished, in one report of its engine's
    connector stats (their plain data decoded: kv_transfer/stats.py)."""
    return [
        TransferReport.from_data(data)
        for part in connector_reports(connector_stats)
        for data in part.get(TRANSFERS, ())
    ]


def stat_logger_factory(stats: EngineStats, metrics, pooled: bool):
    """Keeps the scheduler's figures and the learned step costs in `stats` (Health, Stats, the
    routers' load and route estimates) and counts each finished KV transfer, and (`pooled`: the
    connector is the KV pool's) the prompt tokens loaded from the pool, in the worker's
    Prometheus `metrics` (pdserve/worker/metrics_server.py)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if iteration_stats is not None:
                stats.step_costs.record_iteration(iteration_stats)
            if scheduler_stats is None:
                return
            stats.update(
                scheduler_stats.num_running_reqs,
                scheduler_stats.num_waiting_reqs,
                scheduler_stats.kv_cache_usage,
                engine_idx,
            )
            loaded = pool_loaded_tokens(scheduler_stats.connector_prefix_cache_stats)
            if pooled and loaded:
                metrics.kv_pool_hits.labels("host").inc(loaded)
                stats.pool_loaded_tokens += loaded
            if pooled:
                stats.pool_load_seconds += pool_load_seconds(scheduler_stats.kv_connector_stats)
            for report in kv_transfers(scheduler_stats.kv_connector_stats):
                if (whole := stats.kv_transfer_reported(report)) is not None:
                    metrics.kv_transfer_finished(whole)

        def log_engine_initialized(self):
            pass

    return SchedulerStatsLogger
