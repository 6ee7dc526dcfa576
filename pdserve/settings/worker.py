"""A worker's settings: its role, where it listens, its registry, and its engine."""

from typing import Annotated, Literal

from pydantic import Field

from pdserve.core.kinds import AUTO_TRANSPORT, Role, Transport
from pdserve.settings.base import Settings
from pdserve.settings.engine import EngineSettings
from pdserve.settings.secret_fields import ClusterSecretFile, TlsDir

ROLES = tuple(role.value for role in Role)
RoleName = Literal[ROLES]
KvFailurePolicy = Annotated[
    Literal["recompute", "fail"],
    Field(
        default="recompute",
        description="decode: when a prompt's KV does not arrive in time, prefill it locally "
        "(recompute) or end the request with an error (fail)",
    ),
]
HeartbeatS = Annotated[
    float,
    Field(
        default=1.0,
        gt=0,
        description="registry heartbeat in seconds; a worker that misses two leaves the pools",
        json_schema_extra={"flag": "--heartbeat"},
    ),
]
KvSendBufferMib = Annotated[
    int,
    Field(
        default=256,
        ge=1,
        description="prefill: KV staged and not yet sent, per rank, in MiB (pinned host memory "
        "on GPU); when it is full the forward pass waits (up to 10 s, then the transfer is "
        "cancelled)",
        json_schema_extra={"metavar": "MIB"},
    ),
]
KvTransport = Annotated[
    Literal[(AUTO_TRANSPORT, *(kind.value for kind in Transport))],
    Field(
        default=AUTO_TRANSPORT,
        description="how KV moves to or from this worker: auto (NCCL between GPU workers, "
        "shared memory between CPU workers on one host, else gRPC), or force grpc, nccl (gloo "
        "on CPU) or shm (one host only); a prefill worker's forced choice wins over its decode "
        "worker's",
    ),
]
KvIntegrity = Annotated[
    Literal["on", "off"],
    Field(
        default="on",
        description="every KV slice carries a digest of its bytes, checked where it lands, and "
        "its transfer's epoch and sequence number; a slice that fails a check fails its "
        "transfer (the kv failure policy applies). off is for measuring the cost only",
    ),
]


KvPool = Annotated[
    Literal["on", "off"],
    Field(
        default="on",
        description="share computed prefix blocks through the host's KV pool (docs/kv-pool.md): "
        "the engine stores the blocks it computes (or receives) there, and loads from there a "
        "prefix any worker of the host computed instead of computing it (a decode worker: for "
        "the prompts it computes itself); with no --kv-pool-address there is no pool, and a "
        "decode or flex worker with --kv-failure-policy fail uses none (a pool miss would end "
        "its request)",
    ),
]

KvPoolAddress = Annotated[
    str,
    Field(
        default="",
        description="the host KV pool's store (a Unix socket: a path, or @name for an abstract "
        "one); `pdserve serve` starts one and sets it",
    ),
]


OtlpEndpoint = Annotated[
    str,
    Field(
        default="",
        description="export OpenTelemetry traces over OTLP/gRPC to this collector "
        "(http://HOST:4317: plain; https://: TLS): one trace per request across the router and "
        "its workers, vLLM's request spans included (default: none, and no cost)",
        json_schema_extra={"metavar": "URL"},
    ),
]
ClusterName = Annotated[
    str, Field(default="pdserve", description="the cluster's name in the registry")
]


class WorkerSettings(Settings):
    role: RoleName = Field(
        Role.COLOCATED.value,
        description="colocated: prefills and decodes its own requests; prefill: "
        "computes prompts and sends their KV; decode: receives KV and "
        "decodes (and prefills short prompts itself); flex: can do either, the router "
        "assigns it the prefill or the decode role and changes it live",
    )
    host: str = Field("127.0.0.1", description="gRPC bind address")
    port: int = Field(50051, ge=0, description="gRPC port (0: any free port)")
    metrics_port: int = Field(
        0,
        ge=0,
        description="HTTP port of the worker's Prometheus /metrics (vLLM's engine metrics and "
        "pdserve's), on --host (0: any free port; the worker logs the URL)",
    )
    health_port: int = Field(
        0,
        ge=0,
        description="also answer grpc.health.v1, and nothing else, in plaintext on this port: "
        "Kubernetes' gRPC probes speak no TLS, so with --tls-dir they ask here (0: none; "
        "the health service is on --port either way)",
    )
    worker_id: str = Field(
        "", description="name in logs, stats and the registry (default: ROLE@HOST:PORT)"
    )
    advertise_host: str = Field(
        "",
        description="the host others reach this worker at "
        "(default: --host, or this host's address when "
        "--host is 0.0.0.0)",
    )
    kv_port: int = Field(
        0,
        ge=0,
        description="decode: port of the KV receiver; rank r of a "
        "tensor-parallel worker uses PORT + r (0: any free "
        "port at TP 1)",
    )
    kv_failure_policy: KvFailurePolicy
    kv_send_buffer_mib: KvSendBufferMib
    kv_transport: KvTransport
    kv_integrity: KvIntegrity
    kv_pool: KvPool
    kv_pool_address: KvPoolAddress
    otlp_endpoint: OtlpEndpoint
    cluster_secret_file: ClusterSecretFile
    tls_dir: TlsDir
    registry: str = Field(
        "",
        description="join the pools in this Redis registry "
        "(redis://host:port/db) once the engine is ready "
        "(default: none, as under `pdserve serve`)",
        json_schema_extra={"metavar": "REDIS_URL"},
    )
    cluster: ClusterName
    heartbeat_s: HeartbeatS
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @property
    def pooled(self) -> bool:
        """The engine shares prefix blocks through the host's KV pool."""
        return self.wants_kv_pool and bool(self.kv_pool_address)

    @property
    def wants_kv_pool(self) -> bool:
        """Whether this worker uses its host's KV pool once given its address (a launcher
        starts the host's store for it): every role does, unless the pool is off or the
        worker receives KV under `--kv-failure-policy fail`. vLLM applies one failure policy
        to all its connectors' loads, so under `fail` a pool block evicted between its lookup
        and its load, or a restarted store, would end the request instead of being computed."""
        return self.kv_pool == "on" and not (
            self.role in (Role.DECODE, Role.FLEX) and self.kv_failure_policy == "fail"
        )

    @property
    def kv_pool_group(self) -> str:
        """Which of a host's workers may share one KV pool store: a store holds blocks of one
        layout (a part per tensor-parallel rank), so workers of another tensor-parallel size
        (a 1P1D whose prefill and decode TP differ) get a store of their own; the store would
        refuse whichever joined second."""
        return f"tp{self.engine.tensor_parallel_size}"
