"""Where each worker goes, and the checks that refuse an impossible cluster before anything starts.

One placement group per worker: `tensor_parallel_size` bundles of one GPU each (one CPU each for
a `gpu_type: cpu` pool), STRICT_PACK so a tensor-parallel group stays on one node. A worker of a
data-parallel group (docs/deepseek.md) holds its node's ranks' GPUs as one bundle instead: its
vLLM runs them itself (a process per rank, as on one machine), and the group's other workers,
one per node, join its node 0 over the network, so a group spans nodes as its workers do. The
checks
need no engine and download nothing: the model's shape and size come from a planner preset, a
known Hugging Face id, or the model folder's config.json; the resources from Ray's nodes (or
this host's for a local cluster); each GPU pool's memory from its GPU type's datasheet.
"""

from dataclasses import dataclass, replace
from pathlib import Path

from kv_transfer.head_shards import check_shardable
from pdserve.core.gpu_spec import GPU_PRESETS
from pdserve.model_store.store import ModelError, resolve_model
from pdserve.planner.capacity import GIB
from pdserve.planner.memory_fit import GpuMemoryUse, gpu_memory_use, misfits
from pdserve.planner.model_spec import (
    HUB_CHECKPOINTS,
    MODEL_PRESETS,
    ModelSpec,
    from_hf_config,
    hub_checkpoint,
)
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import ClusterFile, PoolSection


@dataclass(frozen=True)
class WorkerSlot:
    name: str  # "prefill-0": the Ray actor's name in the namespace
    role: str
    tensor_parallel_size: int
    bundles: tuple[dict[str, float], ...]  # the placement group's bundles
    group_node: int = 0  # its node in its data-parallel group (0: it leads the group)
    group_nodes: int = 1  # workers of its group, one per node

    @property
    def device(self) -> str:
        return next(iter(self.bundles[0]))  # "GPU" or "CPU"

    @property
    def devices(self) -> int:
        """GPUs (or CPUs) the worker holds, all on one node."""
        return round(sum(amount for bundle in self.bundles for amount in bundle.values()))

    @property
    def leader(self) -> str:
        """The name of its group's node 0: the worker whose host the others join."""
        role, index = self.name.rsplit("-", 1)
        return f"{role}-{int(index) - self.group_node}"


def bundles(pool: PoolSection) -> tuple[dict[str, float], ...]:
    """A GPU per rank, or a data-parallel worker's GPUs as one bundle (its actor holds them)."""
    device = "GPU" if pool.uses_gpus else "CPU"
    if pool.data_parallel_size > 1:
        return ({device: float(pool.gpus_per_worker)},)
    return tuple({device: 1.0} for _ in range(pool.tensor_parallel_size))


def worker_slots(
    config: ClusterFile,
    counts: dict[str, int] | None = None,
    first_index: dict[str, int] | None = None,
) -> list[WorkerSlot]:
    """The workers of each pool, `counts[role]` replicas (default: the file's; a pool not in
    `counts`: none), each replica a group of `workers_per_replica` workers with consecutive
    names, named from `first_index[role]` on (scale-up names new workers after the existing
    ones)."""
    slots = []
    for role, pool in config.pools().items():
        count = pool.replicas if counts is None else counts.get(role, 0)
        start = (first_index or {}).get(role, 0)
        nodes = pool.workers_per_replica
        slots += [
            WorkerSlot(
                f"{role}-{start + i * nodes + node}",
                role,
                pool.tensor_parallel_size,
                bundles(pool),
                node,
                nodes,
            )
            for i in range(count)
            for node in range(nodes)
        ]
    return slots


def slot_named(config: ClusterFile, name: str) -> WorkerSlot:
    """The slot of worker `name` ("decode-3"), as `worker_slots` names it: what the replica
    keeper starts again when that worker dies (in a group: its node, joining node 0)."""
    role, index = name.rsplit("-", 1)
    if role not in config.pools() or not index.isdigit():
        raise ValueError(f"not a worker name of this cluster: {name!r}")
    node = int(index) % config.pool(role).workers_per_replica
    return worker_slots(config, {role: 1}, {role: int(index) - node})[node]


def model_shape(config: ClusterFile) -> ModelSpec:
    """The model as the checks see it (head layout, parameters, how its checkpoint stores them):
    a planner preset, a known Hugging Face id (HUB_CHECKPOINTS; the preset, when given, still
    names the shape), or the model folder's config."""
    known = hub_checkpoint(config.model.path)
    if config.model.preset:
        if config.model.preset not in MODEL_PRESETS:
            raise ConfigError(
                f"model.preset: must be one of {', '.join(MODEL_PRESETS)}, got "
                f"{config.model.preset!r}"
            )
        quantization = known.quantization if known else None
        return replace(MODEL_PRESETS[config.model.preset], quantization=quantization)
    if known is not None:
        return known
    hint = (
        f"for a model not on this host, set model.preset ({', '.join(MODEL_PRESETS)}) so its "
        f"layout can be checked (known ids need none: {', '.join(HUB_CHECKPOINTS)})"
    )
    try:
        folder = Path(resolve_model(config.model.path))
    except ModelError as error:
        raise ConfigError(f"model.path: {error}; {hint}") from None
    if not (folder / "config.json").is_file():  # a hub id: vLLM fetches it on the workers
        raise ConfigError(f"model.path: {config.model.path!r} is not a folder here; {hint}")
    try:
        return from_hf_config(folder)
    except ValueError as error:
        raise ConfigError(f"model.path: {error}") from None


def check_layout(config: ClusterFile, model: ModelSpec) -> None:
    """Tensor parallelism must split the attention heads evenly, and shard the KV heads as vLLM
    does (TP divides them, or they divide TP and each is replicated; an MLA latent is replicated
    on every rank). The two pools' TPs may differ: the KV transfer re-shards the heads between
    them. Expert parallelism needs experts, at least one per GPU of the group."""
    for role, pool in config.pools().items():
        tp = pool.tensor_parallel_size
        if not pool.replicas:
            continue
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"{role}.tensor_parallel_size: {tp} does not divide the "
                f"model's {model.num_attention_heads} attention heads ({model.name})"
            )
        if pool.enable_expert_parallel and model.moe is None:
            raise ConfigError(
                f"{role}.enable_expert_parallel: {model.name} has no experts (a dense model: "
                "use data_parallel_size or replicas alone)"
            )
        if pool.enable_expert_parallel and pool.expert_parallel_size > model.moe.num_experts:
            raise ConfigError(
                f"{role}.enable_expert_parallel: an EP group of {pool.expert_parallel_size} "
                f"GPUs (data_parallel_size x tensor_parallel_size) exceeds {model.name}'s "
                f"{model.moe.num_experts} routed experts"
            )
        try:
            check_shardable(model.num_kv_heads, tp)
        except ValueError:
            raise ConfigError(
                f"{role}.tensor_parallel_size: {tp} neither divides nor is a multiple of the "
                f"model's {model.num_kv_heads} KV heads ({model.name})"
            ) from None


def served_weights(config: ClusterFile, model: ModelSpec) -> ModelSpec:
    """`model` as the workers load it: in the file's dtype (unless `auto`: the model's own), and
    quantized as its checkpoint is, else as `model.quantization` asks vLLM to do online."""
    try:
        if config.model.dtype != "auto":
            model = model.with_dtype(config.model.dtype)
    except ValueError as error:
        raise ConfigError(f"model.dtype: {error}") from None
    return replace(model, quantization=model.quantization or config.model.quantization)


def memory_use(config: ClusterFile, model: ModelSpec) -> list[GpuMemoryUse]:
    """Per GPU of each GPU pool with workers: weights, KV cache, activations and pdserve's KV
    buffers (pdserve/planner/memory_fit.py). CPU pools are not checked."""
    pools = {
        role: pool for role, pool in config.pools().items() if pool.replicas and pool.uses_gpus
    }
    if pools:
        model = served_weights(config, model)
    uses = []
    for role, pool in pools.items():
        try:
            uses.append(
                gpu_memory_use(
                    role,
                    model,
                    GPU_PRESETS[pool.gpu_type],
                    pool.tensor_parallel_size,
                    config.kv_cache_gib(pool) * GIB,
                    getattr(pool, "kv_send_buffer_mib", 0),  # a decode pool sends nothing
                    data_parallel_size=pool.data_parallel_size,
                    expert_parallel=pool.enable_expert_parallel,
                )
            )
        except ValueError as error:
            raise ConfigError(f"model: {error}") from None
    return uses


def check_memory(uses: list[GpuMemoryUse]) -> None:
    """Each GPU pool's weights, KV cache, activations and buffers must fit its card."""
    refusal = misfits(uses)
    if refusal is not None:
        raise ConfigError(
            f"{refusal} (lower <pool>.kv_cache_gib, raise the pool's tensor_parallel_size, or "
            "use a quantized checkpoint)"
        )


def check_resources(slots: list[WorkerSlot], nodes: list[dict[str, float]]) -> None:
    """Every worker's bundles must fit on one node (STRICT_PACK), all of them together in the
    cluster: first-fit over the nodes' free resources, as Ray would place them. A group's
    workers may share a node or not: each runs its own ranks."""
    needed: dict[str, float] = {}
    for slot in slots:
        needed[slot.device] = needed.get(slot.device, 0) + slot.devices
    for device, amount in needed.items():
        have = sum(node.get(device, 0) for node in nodes)
        if amount > have:
            raise ConfigError(
                f"the cluster needs {amount:g} {device} in all but has {have:g} "
                f"({len(nodes)} node(s))"
            )
    free = [dict(node) for node in nodes]
    for slot in slots:
        node = next((n for n in free if n.get(slot.device, 0) >= slot.devices), None)
        if node is None:
            largest = max((n.get(slot.device, 0) for n in nodes), default=0)
            knob = "tensor_parallel_size" if slot.group_nodes == 1 else "data_parallel_size_local"
            raise ConfigError(
                f"{slot.role}.{knob}: {slot.name} needs {slot.devices} {slot.device} on one "
                f"node, and no node has that many free (the largest has {largest:g})"
            )
        node[slot.device] -= slot.devices


def describe_plan(slots: list[WorkerSlot]) -> str:
    lines = [f"{'worker':<12} {'role':<8} {'TP':>3}  bundles (STRICT_PACK)"]
    for slot in slots:
        ranks = slot.devices // slot.tensor_parallel_size
        group = f"  {ranks} DP ranks, node {slot.group_node} of {slot.leader}'s group"
        lines.append(
            f"{slot.name:<12} {slot.role:<8} {slot.tensor_parallel_size:>3}  "
            + " ".join(f"{{{k}: {v:g}}}" for b in slot.bundles for k, v in b.items())
            + (group if slot.group_nodes > 1 else "")
        )
    return "\n".join(lines)
