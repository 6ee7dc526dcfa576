"""The cluster file (YAML) that `pdserve up`, `down`, `status` and `scale` read.

Every field is checked before anything starts, and a bad one is refused with its dotted path:
`prefill.tensor_parallel_size: must be an integer >= 1, got 0`. README.md documents the schema;
`deploy/clusters/` holds worked files.
"""

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from planner.gpu_spec import GPU_PRESETS
from router.disaggregation import ADMISSIONS, AFTER_PREFILL
from router.policies import POLICIES

CPU = "cpu"
TRANSPORTS = ("grpc",)
KV_FAILURE_POLICIES = ("recompute", "fail")


class ConfigError(ValueError):
    """A cluster file refused, naming the field."""


@dataclass(frozen=True)
class ModelSection:
    path: str = "smollm2"              # a `pdserve model` name, a HF folder, or a HF id (GPU hosts)
    served_name: str = ""              # what clients send as "model" (default: path)
    dtype: str = "float32"
    max_model_len: int | None = None   # default: the model's own
    quantization: str | None = None    # vLLM's, e.g. "fp8"
    preset: str = ""                   # planner preset giving the head layout when path is not local


@dataclass(frozen=True)
class EngineSection:
    kv_cache_gib: float = 2.0
    seed: int = 0


@dataclass(frozen=True)
class PoolSection:
    replicas: int = 1
    tensor_parallel_size: int = 1
    gpu_type: str = CPU                # "cpu", or a GPU preset (A100-80GB, H100-SXM, H200, L40S)
    kv_failure_policy: str = "recompute"  # decode pool only

    @property
    def uses_gpus(self) -> bool:
        return self.gpu_type != CPU


@dataclass(frozen=True)
class TransportSection:
    kind: str = "grpc"
    kv_timeout_s: float = 30.0


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round-robin"
    disaggregate_min_tokens: int = 256
    decode_admission: str = AFTER_PREFILL
    default_max_tokens: int = 512
    request_timeout_s: float = 600.0


@dataclass(frozen=True)
class RegistrySection:
    url: str = ""                      # redis://host:port/db; empty: `up` starts one (embedded)
    embedded: bool = True
    heartbeat_s: float = 1.0           # a worker that misses two heartbeats leaves the pools


@dataclass(frozen=True)
class ClusterConfig:
    name: str = "pdserve"
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    prefill: PoolSection = field(default_factory=PoolSection)
    decode: PoolSection = field(default_factory=PoolSection)
    transport: TransportSection = field(default_factory=TransportSection)
    router: RouterSection = field(default_factory=RouterSection)
    registry: RegistrySection = field(default_factory=RegistrySection)

    @property
    def served_model(self) -> str:
        return self.model.served_name or self.model.path

    def pool(self, role: str) -> PoolSection:
        return {"prefill": self.prefill, "decode": self.decode}[role]


def load_cluster_file(path: str | Path) -> ClusterConfig:
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


def parse_cluster(document) -> ClusterConfig:
    config = _section(ClusterConfig, document if document is not None else {}, "")
    _check(config)
    return config


def _section(kind, value, where: str):
    """Build dataclass `kind` from a mapping, refusing unknown keys and wrong types."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where or 'the file'}: must be a mapping, got {_show(value)}")
    known = {f.name: f for f in fields(kind)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"{_join(where, unknown[0])}: unknown field (known: {', '.join(known)})")
    values = {}
    for name, raw in value.items():
        spec = known[name]
        place = _join(where, name)
        if isinstance(spec.default_factory, type):  # a nested section
            values[name] = _section(spec.default_factory, raw if raw is not None else {}, place)
        else:
            values[name] = _scalar(raw, spec.type, place)
    return kind(**values)


def _scalar(raw, kind, where: str):
    optional = kind in (int | None, str | None)
    if raw is None and optional:
        return None
    base = {int | None: int, str | None: str}.get(kind, kind)
    if base is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if base is bool and isinstance(raw, bool):
        return raw
    if base in (int, str, float) and isinstance(raw, base) and not isinstance(raw, bool):
        return raw
    name = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[base]
    raise ConfigError(f"{where}: must be {name}, got {_show(raw)}")


def _check(config: ClusterConfig) -> None:
    _at_least(config.prefill.replicas, 0, "prefill.replicas")
    _at_least(config.decode.replicas, 1, "decode.replicas")
    for role in ("prefill", "decode"):
        pool = config.pool(role)
        _at_least(pool.tensor_parallel_size, 1, f"{role}.tensor_parallel_size")
        _one_of(pool.gpu_type, (CPU, *GPU_PRESETS), f"{role}.gpu_type")
        _one_of(pool.kv_failure_policy, KV_FAILURE_POLICIES, f"{role}.kv_failure_policy")
    _one_of(config.transport.kind, TRANSPORTS, "transport.kind")
    _one_of(config.router.policy, tuple(sorted(POLICIES)), "router.policy")
    _one_of(config.router.decode_admission, ADMISSIONS, "router.decode_admission")
    _positive(config.transport.kv_timeout_s, "transport.kv_timeout_s")
    _positive(config.registry.heartbeat_s, "registry.heartbeat_s")
    _positive(config.engine.kv_cache_gib, "engine.kv_cache_gib")
    _at_least(config.router.port, 0, "router.port")
    _at_least(config.router.disaggregate_min_tokens, 0, "router.disaggregate_min_tokens")
    _at_least(config.router.default_max_tokens, 1, "router.default_max_tokens")
    if config.model.max_model_len is not None:
        _at_least(config.model.max_model_len, 1, "model.max_model_len")
    if not config.name.replace("-", "").isalnum():
        raise ConfigError(f"name: letters, digits and '-' only, got {config.name!r}")
    if config.registry.url and not config.registry.url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"registry.url: must start with redis://, got {config.registry.url!r}")
    if not config.registry.url and not config.registry.embedded:
        raise ConfigError("registry: give a url, or embedded: true")


def _at_least(value: int, low: int, where: str) -> None:
    if value < low:
        raise ConfigError(f"{where}: must be an integer >= {low}, got {value}")


def _positive(value: float, where: str) -> None:
    if not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value}")


def _one_of(value: str, allowed: tuple[str, ...], where: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{where}: must be one of {', '.join(allowed)}, got {value!r}")


def _join(where: str, name) -> str:
    return f"{where}.{name}" if where else str(name)


def _show(value) -> str:
    return f"{type(value).__name__} {value!r}"
