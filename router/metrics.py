"""The router's Prometheus metrics, measured where the client sees them.

TTFT is request arrival at the router -> first token sent to the client; inter-token latency is
the gap between consecutive token chunks; end-to-end is arrival -> last byte. Each app has its
own registry, so several routers (in tests) never share counters.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
KV_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 34, 2))  # 64 KiB .. 8 GiB
TOKEN_GAP_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "Finished HTTP requests, once each however many prompts it had (a batch), by "
            "endpoint and status: the HTTP status code, the error's for a stream that failed "
            "after its 200 was sent, 499 for a client that left first",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pdserve_errors",
            "Failed requests by kind (invalid_request, unsupported_parameter, "
            "model_not_found, context_length, invalid_api_key, rate_limited, worker_unavailable, "
            "worker_error: the worker or its engine failed it, kv_transfer_failed: its KV did "
            "not reach the decode worker, timeout, client_disconnect, internal)",
            ["kind"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival to first token sent",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.inter_token = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive token chunks",
            registry=self.registry,
            buckets=TOKEN_GAP_BUCKETS,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to last token",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens",
            "Generated tokens of finished requests",
            registry=self.registry,
        )
        self.routes = Counter(
            "pdserve_route",
            "Requests started, by path: disaggregated (prefill worker + decode worker), local "
            "(its decode worker prefills and decodes), stay-on-prefill (its prefill worker does)",
            ["path"],
            registry=self.registry,
        )
        self.route_decisions = Counter(
            "pdserve_route_decisions",
            "Each path decision (every attempt), by path (local, disaggregated, stay-on-prefill) "
            "and reason: estimate (the cheapest priced path), length (--route-policy length), "
            "below_floor, header, no_prefill_worker, prefill_lost",
            ["path", "reason"],
            registry=self.registry,
        )
        self.kv_bytes = Histogram(
            "pdserve_kv_transfer_bytes",
            "KV bytes received per transfer (decode worker), by what carried them (grpc, shm, "
            "nccl between GPUs, gloo: the nccl transport between CPU workers)",
            ["transport"],
            registry=self.registry,
            buckets=KV_BYTES_BUCKETS,
        )
        self.kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "First KV slice received -> last slice received (decode worker), by what carried "
            "them (grpc, shm, nccl, gloo)",
            ["transport"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.kv_transfers = Counter(
            "pdserve_kv_transfers",
            "KV transfers of disaggregated requests, by the transport the router chose "
            "(grpc, nccl, shm) and outcome (loaded, failed)",
            ["transport", "outcome"],
            registry=self.registry,
        )
        self.kv_failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that did not complete, by reason "
            "(prefill_failed, timeout, cancelled, refused, integrity; not_held: the decode "
            "worker lacked the prefix blocks it was not sent, and computed the prompt)",
            ["reason"],
            registry=self.registry,
        )
        self.queue_length = Gauge(
            "pdserve_queue_length",
            "Requests waiting in the router's queue for a turn (admission control)",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds",
            "How long admitted requests waited in the router's queue",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.admitted = Counter(
            "pdserve_admitted",
            "Requests given a turn by admission control",
            registry=self.registry,
        )
        self.rejected = Counter(
            "pdserve_rejected",
            "Requests refused with 429: the router's queue was full, or its wait ran out",
            registry=self.registry,
        )
        self.migrations = Counter(
            "pdserve_migrations",
            "Requests continued on another decode worker after theirs became unavailable "
            "mid-stream",
            registry=self.registry,
        )
        self.migration_gap = Histogram(
            "pdserve_migration_gap_seconds",
            "A migrated request's pause: its decode worker lost -> first token from the next",
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self.prefill_lost = Counter(
            "pdserve_prefill_lost",
            "Prefill legs whose worker was lost before the prompt's KV was complete, by where "
            "the prompt went next (another_prefill, or local: the decode worker prefilled it)",
            ["next"],
            registry=self.registry,
        )
        self.unresponsive = Counter(
            "pdserve_worker_unresponsive",
            "Times a worker was taken out of the pools for answering nothing (its Stats and "
            "Health) for --worker-unresponsive-timeout, by its role",
            ["role"],
            registry=self.registry,
        )
        self.unresponsive_now = Gauge(
            "pdserve_unresponsive_workers",
            "Workers out of the pools now for answering nothing (back once they answer again)",
            registry=self.registry,
        )
        self.routers = Gauge(
            "pdserve_routers",
            "Routers sharing this cluster's state (this one included; 1 without a registry)",
            registry=self.registry,
        )
        self.routers.set(1)
        self.shared_state_failures = Counter(
            "pdserve_shared_state_failures",
            "Rounds of the shared state's sync that could not reach Redis (served from the "
            "last view meanwhile)",
            registry=self.registry,
        )
        self.registry_refused = Counter(
            "pdserve_registry_records_refused",
            "Registry records ignored for want of a valid cluster-secret signature (a process "
            "that can write to Redis but is not part of the cluster)",
            registry=self.registry,
        )
        self.kv_fallbacks = Counter(
            "pdserve_kv_fallbacks",
            "Disaggregated requests whose decode worker prefilled the prompt itself after all",
            ["policy"],
            registry=self.registry,
        )
