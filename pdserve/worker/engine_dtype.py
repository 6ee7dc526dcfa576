"""The dtype a worker's engine runs in, `auto` resolved per device.

On a GPU `auto` is vLLM's: the model's own (bfloat16 for most). On a CPU vLLM's `auto` is the
model's own too, which is right only where the CPU multiplies bfloat16 natively: with AVX512-BF16
(or AMX) SmolLM2 in bfloat16 decoded ~1.5x faster than in float32 on 2 cores (TPOT p50 22-24
against 33-34 ms, TTFT p50 128-136 against 203-206 ms: docs/benchmarking.md), while on AVX2 alone
bfloat16 ran 4x slower than float32. So on a CPU `auto` is bfloat16 only with those instructions.
"""

AUTO = "auto"


def engine_dtype(dtype: str, cpu: bool) -> str:
    """What vLLM gets for the worker's `dtype` setting on this machine."""
    if dtype != AUTO or not cpu:
        return dtype
    return "bfloat16" if cpu_multiplies_bfloat16() else "float32"


def cpu_multiplies_bfloat16() -> bool:
    """Whether this x86 CPU has bfloat16 dot products (AVX512-BF16 or AMX tiles), as torch's
    own kernels check (vLLM's CPU platform asks torch the same for its AMX paths)."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
