"""Whether a worker fits its GPUs: per GPU, its share of the weights, its KV cache, an allowance
for activations and CUDA graphs, and pdserve's own KV buffers, against the card's memory.

One sum for both users: `pdserve up` checks a cluster file's pools with it before anything
starts (pdserve/cluster/placement.py), and `pdserve plan --write-cluster` sizes each pool's KV
cache with it, so a planned file passes that check. Every term is per GPU: vLLM applies
`kv_cache_memory_bytes` on each tensor-parallel rank (its gpu_worker returns it as that rank's
KV memory), and each rank holds 1/TP of the weights, or, with expert parallelism, 1/EP of the
routed experts and 1/TP of the rest (pdserve/planner/capacity.py's weight_bytes_per_gpu).
"""

import math
from dataclasses import dataclass

from kv_transfer.memory_budget import INBOX_BYTES
from pdserve.core.gpu_spec import GB, GpuSpec
from pdserve.core.kinds import Role
from pdserve.planner.capacity import DEFAULT_RESERVE_FRACTION, GIB, weight_bytes_per_gpu
from pdserve.planner.model_spec import ModelSpec
from pdserve.settings.worker import WorkerSettings

MIB = 2**20
DEFAULT_SEND_BUFFER_MIB = WorkerSettings.model_fields["kv_send_buffer_mib"].default


@dataclass(frozen=True)
class GpuMemoryUse:
    """What one GPU of a `role` worker holds, in bytes."""

    role: str
    gpu: GpuSpec
    tensor_parallel_size: int
    weights: float
    kv_cache: float
    activations: float
    buffers: float
    data_parallel_size: int = 1
    expert_parallel_size: int = 1

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu.memory_bytes

    def describe(self) -> str:
        """`decode TP 4 on H100-SXM: weights 32.85 + KV 30.00 + activations 7.45 + KV buffers
        1.00 = 71.30 GiB per GPU of 74.51 GiB (80 GB)`; a data-parallel group says `TP 1 x DP
        32, EP 32`."""
        layout = f"TP {self.tensor_parallel_size}"
        if self.data_parallel_size > 1:
            layout += f" x DP {self.data_parallel_size}"
        if self.expert_parallel_size > 1:
            layout += f", EP {self.expert_parallel_size}"
        return (
            f"{self.role} {layout} on {self.gpu.name}: weights "
            f"{self.weights / GIB:.2f} + KV {self.kv_cache / GIB:.2f} + activations "
            f"{self.activations / GIB:.2f} + KV buffers {self.buffers / GIB:.2f} = "
            f"{self.total / GIB:.2f} GiB per GPU of {self.gpu.memory_bytes / GIB:.2f} GiB "
            f"({self.gpu.memory_bytes / GB:g} GB)"
        )


def kv_buffer_bytes(role: str, send_buffer_mib: int) -> int:
    """pdserve's own KV buffers on each GPU of a worker, counted where the nccl transport (auto's
    choice between GPU workers) keeps them, on the device: a prefill rank's send budget
    (`kv_send_buffer_mib`: gathered slices not yet sent), a decode rank's inbox
    (kv_transfer/memory_budget.py INBOX_BYTES: received slices not yet loaded); a flex worker has
    both."""
    sends = send_buffer_mib * MIB if role in (Role.PREFILL, Role.FLEX) else 0
    receives = INBOX_BYTES if role in (Role.DECODE, Role.FLEX) else 0
    return sends + receives


def gpu_memory_use(
    role: str,
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int,
    kv_cache_bytes: float,
    send_buffer_mib: int,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    data_parallel_size: int = 1,
    expert_parallel: bool = False,
) -> GpuMemoryUse:
    """One GPU of a worker: its share of the weights (at the model's dtype and quantization:
    1/TP, or with `expert_parallel` 1/(DP x TP) of the routed experts), the KV cache given per
    GPU, `reserve_fraction` of the card for activations, CUDA graphs, the CUDA context and
    NCCL's own buffers (what vLLM's default gpu_memory_utilization of 0.9 keeps back; DeepEP's
    all-to-all buffers come out of it too), and pdserve's KV buffers."""
    ep = data_parallel_size * tensor_parallel_size if expert_parallel else 1
    return GpuMemoryUse(
        role=role,
        gpu=gpu,
        tensor_parallel_size=tensor_parallel_size,
        weights=weight_bytes_per_gpu(model, tensor_parallel_size, ep),
        kv_cache=kv_cache_bytes,
        activations=gpu.memory_bytes * reserve_fraction,
        buffers=kv_buffer_bytes(role, send_buffer_mib),
        data_parallel_size=data_parallel_size,
        expert_parallel_size=ep,
    )


def kv_cache_gib_that_fits(
    role: str,
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int,
    send_buffer_mib: int = DEFAULT_SEND_BUFFER_MIB,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    data_parallel_size: int = 1,
    expert_parallel: bool = False,
) -> int:
    """The most whole GiB of KV cache per GPU that fit beside everything else (0: none does):
    what `pdserve plan --write-cluster` gives each pool."""
    use = gpu_memory_use(
        role,
        model,
        gpu,
        tensor_parallel_size,
        0,
        send_buffer_mib,
        reserve_fraction,
        data_parallel_size,
        expert_parallel,
    )
    return max(0, math.floor((gpu.memory_bytes - use.total) / GIB))


def misfits(uses: list[GpuMemoryUse]) -> str | None:
    """The refusal naming every worker that does not fit, with its numbers; None if all fit."""
    over = [use for use in uses if not use.fits]
    if not over:
        return None
    return "does not fit in GPU memory: " + "; ".join(
        f"{use.describe()}, {(use.total - use.gpu.memory_bytes) / GIB:.2f} GiB over" for use in over
    )
