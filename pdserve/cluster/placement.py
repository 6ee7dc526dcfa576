"""Where each worker goes, and the checks that refuse an impossible cluster before anything starts.

One placement group per worker: `tensor_parallel_size` bundles of one GPU each (one CPU each for
a `gpu_type: cpu` pool), STRICT_PACK so a tensor-parallel group stays on one node. The checks
need no engine: the head layout comes from the model's config.json or a planner preset, the
resources from Ray's nodes (or this host's for a local cluster).
"""

from dataclasses import dataclass
from pathlib import Path

from kv_transfer.head_shards import check_shardable
from pdserve.model_store.store import ModelError, resolve_model
from pdserve.planner.model_spec import MODEL_PRESETS, ModelSpec, from_hf_config
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import ClusterFile, PoolSection


@dataclass(frozen=True)
class WorkerSlot:
    name: str  # "prefill-0": the Ray actor's name in the namespace
    role: str
    tensor_parallel_size: int
    bundles: tuple[dict[str, float], ...]  # the placement group's bundles

    @property
    def device(self) -> str:
        return next(iter(self.bundles[0]))  # "GPU" or "CPU"


def bundles(pool: PoolSection) -> tuple[dict[str, float], ...]:
    device = "GPU" if pool.uses_gpus else "CPU"
    return tuple({device: 1.0} for _ in range(pool.tensor_parallel_size))


def worker_slots(
    config: ClusterFile,
    counts: dict[str, int] | None = None,
    first_index: dict[str, int] | None = None,
) -> list[WorkerSlot]:
    """The workers of each pool, `counts[role]` of them (default: the file's replicas; a pool
    not in `counts`: none), named from `first_index[role]` on (scale-up names new workers after
    the existing ones)."""
    slots = []
    for role, pool in config.pools().items():
        count = pool.replicas if counts is None else counts.get(role, 0)
        start = (first_index or {}).get(role, 0)
        slots += [
            WorkerSlot(f"{role}-{start + i}", role, pool.tensor_parallel_size, bundles(pool))
            for i in range(count)
        ]
    return slots


def slot_named(config: ClusterFile, name: str) -> WorkerSlot:
    """The slot of worker `name` ("decode-3"), as `worker_slots` names it: what the replica
    keeper starts again when that worker dies."""
    role, index = name.rsplit("-", 1)
    if role not in config.pools() or not index.isdigit():
        raise ValueError(f"not a worker name of this cluster: {name!r}")
    return worker_slots(config, {role: 1}, {role: int(index)})[0]


def model_shape(config: ClusterFile) -> ModelSpec:
    """The head layout to check TP against: a planner preset, or the model folder's config."""
    if config.model.preset:
        if config.model.preset not in MODEL_PRESETS:
            raise ConfigError(
                f"model.preset: must be one of {', '.join(MODEL_PRESETS)}, got "
                f"{config.model.preset!r}"
            )
        return MODEL_PRESETS[config.model.preset]
    hint = (
        f"for a model not on this host, set model.preset ({', '.join(MODEL_PRESETS)}) so its "
        "layout can be checked"
    )
    try:
        folder = Path(resolve_model(config.model.path))
    except ModelError as error:
        raise ConfigError(f"model.path: {error}; {hint}") from None
    if not (folder / "config.json").is_file():  # a hub id: vLLM fetches it on the workers
        raise ConfigError(f"model.path: {config.model.path!r} is not a folder here; {hint}")
    return from_hf_config(folder)


def check_layout(config: ClusterFile, model: ModelSpec) -> None:
    """Tensor parallelism must split the attention heads evenly, and shard the KV heads as vLLM
    does (TP divides them, or they divide TP and each is replicated). The two pools' TPs may
    differ: the KV transfer re-shards the heads between them."""
    for role, pool in config.pools().items():
        tp = pool.tensor_parallel_size
        if not pool.replicas:
            continue
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"{role}.tensor_parallel_size: {tp} does not divide the "
                f"model's {model.num_attention_heads} attention heads ({model.name})"
            )
        try:
            check_shardable(model.num_kv_heads, tp)
        except ValueError:
            raise ConfigError(
                f"{role}.tensor_parallel_size: {tp} neither divides nor is a multiple of the "
                f"model's {model.num_kv_heads} KV heads ({model.name})"
            ) from None


def check_resources(slots: list[WorkerSlot], nodes: list[dict[str, float]]) -> None:
    """Every worker's bundles must fit on one node (STRICT_PACK), all of them together in the
    cluster: first-fit over the nodes' free resources, as Ray would place them."""
    needed: dict[str, float] = {}
    for slot in slots:
        needed[slot.device] = needed.get(slot.device, 0) + slot.tensor_parallel_size
    for device, amount in needed.items():
        have = sum(node.get(device, 0) for node in nodes)
        if amount > have:
            raise ConfigError(
                f"the cluster needs {amount:g} {device} in all but has {have:g} "
                f"({len(nodes)} node(s))"
            )
    free = [dict(node) for node in nodes]
    for slot in slots:
        node = next((n for n in free if n.get(slot.device, 0) >= slot.tensor_parallel_size), None)
        if node is None:
            largest = max((n.get(slot.device, 0) for n in nodes), default=0)
            raise ConfigError(
                f"{slot.role}.tensor_parallel_size: {slot.name} needs "
                f"{slot.tensor_parallel_size} {slot.device} on one node, and no node has that "
                f"many free (the largest has {largest:g})"
            )
        node[slot.device] -= slot.tensor_parallel_size


def describe_plan(slots: list[WorkerSlot]) -> str:
    lines = [f"{'worker':<12} {'role':<8} {'TP':>3}  bundles (STRICT_PACK)"]
    for slot in slots:
        lines.append(
            f"{slot.name:<12} {slot.role:<8} {slot.tensor_parallel_size:>3}  "
            + " ".join(f"{{{k}: {v:g}}}" for b in slot.bundles for k, v in b.items())
        )
    return "\n".join(lines)
