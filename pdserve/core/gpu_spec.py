"""GPUs as the capacity math sees them: memory size, memory bandwidth, 16-bit tensor throughput."""

import os
import shutil
import subprocess
from dataclasses import dataclass

GB = 10**9
TFLOPS = 10**12

DEFAULT_ACHIEVABLE_COMPUTE_FRACTION = 0.5
"""Share of peak tensor throughput a long prefill reaches in practice (model FLOPs utilisation)."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU, in bytes, bytes/s and FLOP/s, decimal as datasheets quote them.

    `peak_flops` is the dense (no sparsity) FP16/BF16 tensor-core figure, and only the
    `achievable_compute_fraction` of it is counted for prefill time. Bandwidth is taken at its
    peak because the decode figure it feeds is a lower bound. Memory is the nominal capacity;
    HBM parts report a little more to nvidia-smi, which errs on the safe side.
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    achievable_compute_fraction: float = DEFAULT_ACHIEVABLE_COMPUTE_FRACTION

    @classmethod
    def from_datasheet(
        cls, name: str, memory_gb: float, bandwidth_gb_per_s: float, tflops: float
    ) -> "GpuSpec":
        """A GPU from its datasheet units: GB of memory, GB/s of bandwidth, dense FP16 TFLOPS."""
        return cls(name, int(memory_gb * GB), bandwidth_gb_per_s * GB, tflops * TFLOPS)


GPU_PRESETS = {
    gpu.name: gpu
    for gpu in (
        GpuSpec.from_datasheet("A100-80GB", 80, 2039, 312),
        GpuSpec.from_datasheet("H100-SXM", 80, 3350, 989),
        GpuSpec.from_datasheet("H200", 141, 4800, 989),
        GpuSpec.from_datasheet("L40S", 48, 864, 362),
    )
}


def gpu_preset(name: str) -> GpuSpec:
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)}") from None


def local_gpus() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES' entries if set, else nvidia-smi's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
