"""A worker's Prometheus endpoint (`GET /metrics` on `--metrics-port`): vLLM's own engine
metrics (`vllm:*`: running and waiting requests, KV cache usage, prefix cache hits, step and
request times), which vLLM registers in prometheus_client's default registry when the engine
starts, plus pdserve's worker series below.

The KV transfer series are counted by the decode worker, which measures every transfer it
receives (first slice -> last slice; kv_transfer/stats.py): a prefill worker exports them at 0.
"""

import logging

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import GetStats
from kv_transfer.transfer_report import TransferReport
from pdserve.protocol import worker_pb2

log = logging.getLogger("pdserve.worker")
State = worker_pb2.HealthReply.State

KV_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 34, 2))  # 64 KiB .. 8 GiB
KV_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    """pdserve's series of one worker process (one per process: the default registry)."""

    def __init__(self, registry=REGISTRY) -> None:
        self.state = Gauge(
            "pdserve_worker_state",
            "1 for the worker's current state (starting, ready, draining, failed), 0 for others",
            ["role", "state"],
            registry=registry,
        )
        self.kv_bytes = Counter(
            "pdserve_worker_kv_transfer_bytes",
            "KV bytes received, by the transport that carried them",
            ["transport"],
            registry=registry,
        )
        self.kv_seconds = Histogram(
            "pdserve_worker_kv_transfer_seconds",
            "Per transfer: first slice received -> last slice received (or the failure)",
            ["transport"],
            buckets=KV_SECONDS_BUCKETS,
            registry=registry,
        )
        self.kv_transfer_size = Histogram(
            "pdserve_worker_kv_transfer_size_bytes",
            "KV bytes per transfer",
            ["transport"],
            buckets=KV_BYTES_BUCKETS,
            registry=registry,
        )
        self.kv_failures = Counter(
            "pdserve_worker_kv_transfer_failures",
            "Transfers whose KV did not arrive: timeout, cancelled (its producer gave up), "
            "refused (the compatibility handshake failed), integrity (a slice failed a check)",
            ["transport", "reason"],
            registry=registry,
        )
        self.kv_loads = Counter(
            "pdserve_worker_kv_transfer_loads",
            "Transfers loaded, by when: in_step (in the engine step that scheduled the request, "
            "its KV having arrived before the request), step_before (in an earlier step, the "
            "request scheduled in the next one: the hand-off costs a step more)",
            ["when"],
            registry=registry,
        )
        self.kv_integrity_failures = Counter(
            "pdserve_kv_integrity_failures",
            "Transfers failed because a slice failed an integrity check, by the transport "
            "that carried it and what was wrong: digest (its bytes changed), length "
            "(truncated), stale (another transfer's), duplicate, order (reordered)",
            ["transport", "kind"],
            registry=registry,
        )

        self.kv_pool_hits = Counter(
            "pdserve_kv_pool_hits",
            "Prompt tokens this worker loaded from the KV pool instead of computing them, by "
            "the pool's tier (host: the host's pool, kv_transfer/pool/store.py; peer: fetched "
            "from another host's pool into this host's first, then loaded from it as host "
            "hits, pdserve/worker/pool_peers.py)",
            ["tier"],
            registry=registry,
        )
        self.kv_pool_load_per_token = Gauge(
            "pdserve_kv_pool_load_seconds_per_token",
            "What loading a prompt token from the KV pool has taken on this worker, by tier "
            "(host: from this host's pool; peer: fetching it from another host's pool into "
            "this one's, before that load; 0 until it loaded one): against "
            "pdserve_worker_prefill_seconds_per_token, what the routers count a load as saving",
            ["tier"],
            registry=registry,
        )
        self.kv_pool_fetch_failures = Counter(
            "pdserve_kv_pool_fetch_failures",
            "Fetches from another host's KV pool that brought less than the router named, by "
            "why: timeout (slower than computing the tokens here), unreachable (the source "
            "worker), refused (no pool there, or another model's), damaged (a block failed its "
            "check: never loadable), evicted (the source no longer held them all), error (a bug: "
            "logged); the rest of the prompt is computed",
            ["reason"],
            registry=registry,
        )
        self.prefill_per_token = Gauge(
            "pdserve_worker_prefill_seconds_per_token",
            "What computing a prompt token takes on this worker, as it learned from its engine "
            "steps (pdserve/worker/step_costs.py; 0 until it ran prefill steps)",
            registry=registry,
        )
        self.registry = registry

    def follow_kv_pool(self, address: str, stats) -> None:
        """The host pool's own figures (all its workers'), asked of its store at each scrape;
        this worker's hits from 0 (so a rate over them starts at its first scrape) and its load
        (host) and fetch (peer) time per token (`stats`: its EngineStats)."""
        self.kv_pool_hits.labels("host")
        self.kv_pool_hits.labels("peer")
        self.kv_pool_load_per_token.labels("host").set_function(stats.pool_load_seconds_per_token)
        self.kv_pool_load_per_token.labels("peer").set_function(stats.pool_fetch_seconds_per_token)
        self.registry.register(KvPoolCollector(PoolClient(address, namespace=None)))

    def follow_state(self, service) -> None:
        """The state gauge reads the worker service's state at every scrape, the prefill cost
        its engine's learned step costs."""
        for name, value in State.items():
            self.state.labels(service.identity.role, name.lower()).set_function(
                lambda value=value: float(service.state == value)
            )
        self.prefill_per_token.set_function(
            lambda: service.engine_stats.step_costs.costs().prefill_s_per_token
        )

    def kv_transfer_finished(self, report: TransferReport) -> None:
        """One finished transfer, its ranks' reports merged (pdserve/worker/engine_stats.py)."""
        transport = report.transport or "none"  # failed before any slice came
        self.kv_bytes.labels(transport).inc(report.bytes)
        self.kv_seconds.labels(transport).observe(report.seconds)
        self.kv_transfer_size.labels(transport).observe(report.bytes)
        if report.failure is not None:
            self.kv_failures.labels(transport, report.failure).inc()
        else:
            self.kv_loads.labels("in_step" if report.in_step else "step_before").inc()
        if report.damage is not None:
            self.kv_integrity_failures.labels(transport, report.damage).inc()


class KvPoolCollector(Collector):
    """pdserve_kv_pool_{bytes,blocks,capacity_bytes,evictions,dropped}{tier="host"}: the host pool's
    size and what it let go; nothing while its store does not answer."""

    def __init__(self, client: PoolClient):
        self.client = client

    def collect(self):
        stats = self.client.call(GetStats())
        if stats is None:
            return
        for name, help_text, kind, value in (
            ("bytes", "KV bytes the pool holds", GaugeMetricFamily, stats.bytes),
            ("blocks", "KV blocks the pool holds", GaugeMetricFamily, stats.used),
            (
                "capacity_bytes",
                "the pool's byte budget, in whole blocks (it never holds more)",
                GaugeMetricFamily,
                stats.slots * stats.slot_bytes or stats.budget_bytes,
            ),
            ("evictions", "blocks evicted to make room", CounterMetricFamily, stats.evictions),
            (
                "dropped",
                "blocks dropped because their bytes failed the reader's check (recomputed)",
                CounterMetricFamily,
                stats.dropped,
            ),
        ):
            family = kind(f"pdserve_kv_pool_{name}", help_text, labels=["tier"])
            family.add_metric(["host"], value)
            yield family


def serve_metrics(host: str, port: int) -> int:
    """Serve the default registry over HTTP on a daemon thread; the port it bound."""
    httpd, _ = start_http_server(port, addr=host)
    bound = httpd.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
