"""Capacity math for one model replica: what fits in GPU memory and how fast a step can go.

Sizes are bytes and times seconds unless a name ends in _ms. A replica is sharded over
`tensor_parallel_size` GPUs, each holding 1/TP of the weights and of the KV cache (attention is
split by heads) and reading its share with its own bandwidth, so TP must divide the heads.
"""

import math
from dataclasses import dataclass

from pdserve.core.gpu_spec import GpuSpec
from pdserve.planner.model_spec import QUANTIZED_BYTES, ModelSpec

GIB = 2**30

DEFAULT_RESERVE_FRACTION = 0.1
"""Share of GPU memory kept back for activations, CUDA graphs and allocator slack; 0.1 is what
vLLM's default gpu_memory_utilization of 0.9 leaves."""


def weight_bytes(model: ModelSpec) -> int:
    """Every parameter in the model's dtype, or, quantized, the decoder layers' linear weights in
    the quantized size and the rest (embeddings, LM head, norms) in the model's dtype."""
    if model.quantization is None:
        return model.num_params * model.bytes_per_param
    if model.quantization not in QUANTIZED_BYTES:
        raise ValueError(
            f"{model.name}: cannot size weights quantized with {model.quantization!r}; "
            f"known: {', '.join(QUANTIZED_BYTES)} (or none)"
        )
    kept = model.unquantized_params
    quantized = model.num_params - kept
    return quantized * QUANTIZED_BYTES[model.quantization] + kept * model.bytes_per_param


def kv_bytes_per_token(model: ModelSpec) -> int:
    """One K and one V vector per layer and KV head: 2 · layers · kv_heads · head_dim · bytes."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.kv_bytes_per_element


def kv_bytes_per_request(model: ModelSpec, context_tokens: int) -> int:
    """KV cache of one request holding `context_tokens` (prompt plus generated tokens)."""
    return kv_bytes_per_token(model) * context_tokens


def kv_budget_bytes(
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
) -> float:
    """Memory per GPU left for KV cache after the reserve and this GPU's share of the weights;
    negative when the weights alone do not fit."""
    weights = _per_gpu(weight_bytes(model), model, tensor_parallel_size)
    return gpu.memory_bytes * (1 - reserve_fraction) - weights


def max_concurrent_requests(
    model: ModelSpec,
    gpu: GpuSpec,
    context_tokens: int,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
) -> int:
    """Requests of `context_tokens` whose KV cache fits in a replica at once (0 if none does).
    Ignores the rounding of KV to vLLM's blocks, at most one block per request."""
    budget = kv_budget_bytes(model, gpu, tensor_parallel_size, reserve_fraction)
    per_request = _per_gpu(kv_bytes_per_request(model, context_tokens), model, tensor_parallel_size)
    return max(0, math.floor(budget / per_request))


def decode_step_lower_bound(
    model: ModelSpec,
    gpu: GpuSpec,
    batch_size: int = 1,
    context_tokens: int = 0,
    tensor_parallel_size: int = 1,
) -> float:
    """Seconds per decode step if memory bandwidth were the only limit.

    A step reads every weight once and the KV cache of every request in the batch once, each GPU
    its 1/TP share at full bandwidth; compute, kernel launches and all-reduces only add to it.
    With the defaults (one request, empty context) it is the weights-only floor that no batch
    beats: 14 GB / 2039 GB/s = 6.9 ms for a 7B FP16 model on an A100-80GB.
    """
    step_bytes = weight_bytes(model) + batch_size * kv_bytes_per_request(model, context_tokens)
    return _per_gpu(step_bytes, model, tensor_parallel_size) / gpu.bandwidth_bytes_per_s


def prefill_flops(model: ModelSpec, prompt_tokens: int) -> int:
    """FLOPs to prefill one prompt: a multiply-add (2 FLOPs) per parameter per token, plus causal
    attention (QKᵀ and AV over the lower triangle): 2 · layers · tokens² · heads · head_dim.
    Counting the embedding lookup as a matmul overstates it by a few percent."""
    matmuls = 2 * model.num_params * prompt_tokens
    attention = 2 * model.num_layers * prompt_tokens**2 * model.num_attention_heads * model.head_dim
    return matmuls + attention


def prefill_time(
    model: ModelSpec, gpu: GpuSpec, prompt_tokens: int, tensor_parallel_size: int = 1
) -> float:
    """Seconds to prefill one prompt at the GPU's achievable share of peak compute."""
    flops = _per_gpu(prefill_flops(model, prompt_tokens), model, tensor_parallel_size)
    return flops / (gpu.peak_flops * gpu.achievable_compute_fraction)


@dataclass(frozen=True)
class CapacityPlan:
    """The figures `pdserve plan` prints for one model replica on one GPU type.

    Byte sizes are for the whole replica (divide by TP for one GPU). The decode lower bound is
    the weights-only floor; the one at batch adds the KV cache of `batch_size` requests each
    holding `context_tokens`. Prefill time is for one prompt of `context_tokens`.
    """

    model: str
    gpu: str
    tensor_parallel_size: int
    context_tokens: int
    reserve_fraction: float
    batch_size: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    max_concurrent_requests: int
    decode_step_lower_bound_ms: float
    decode_step_lower_bound_at_batch_ms: float
    prefill_time_ms: float


def plan_capacity(
    model: ModelSpec,
    gpu: GpuSpec,
    context_tokens: int = 8192,
    batch_size: int | None = None,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
) -> CapacityPlan:
    """All figures for one replica; `batch_size` defaults to as many requests as fit.
    Raises ValueError when not even one request fits, or the batch does not."""
    fits = max_concurrent_requests(
        model, gpu, context_tokens, tensor_parallel_size, reserve_fraction
    )
    if fits == 0:
        tp = tensor_parallel_size
        weights_gib = weight_bytes(model) / tp / GIB
        request_gib = kv_bytes_per_request(model, context_tokens) / tp / GIB
        usable_gib = gpu.memory_bytes * (1 - reserve_fraction) / GIB
        raise ValueError(
            f"{model.name} does not fit on {gpu.name} at TP {tp}: per GPU, "
            f"{weights_gib:.2f} GiB of weights plus {request_gib:.2f} GiB of KV for one "
            f"{context_tokens}-token request exceed the {usable_gib:.2f} GiB left after the reserve"
        )
    batch = fits if batch_size is None else batch_size
    if batch > fits:
        raise ValueError(
            f"batch {batch} exceeds the {fits} requests of {context_tokens} tokens that fit"
        )
    return CapacityPlan(
        model=model.name,
        gpu=gpu.name,
        tensor_parallel_size=tensor_parallel_size,
        context_tokens=context_tokens,
        reserve_fraction=reserve_fraction,
        batch_size=batch,
        weight_bytes=weight_bytes(model),
        kv_bytes_per_token=kv_bytes_per_token(model),
        kv_bytes_per_request=kv_bytes_per_request(model, context_tokens),
        max_concurrent_requests=fits,
        decode_step_lower_bound_ms=1e3
        * decode_step_lower_bound(model, gpu, tensor_parallel_size=tensor_parallel_size),
        decode_step_lower_bound_at_batch_ms=1e3
        * decode_step_lower_bound(model, gpu, batch, context_tokens, tensor_parallel_size),
        prefill_time_ms=1e3 * prefill_time(model, gpu, context_tokens, tensor_parallel_size),
    )


def _per_gpu(amount: float, model: ModelSpec, tensor_parallel_size: int) -> float:
    """One GPU's share of `amount` in a TP group; TP splits attention by heads, so it must
    divide both the query and the KV heads."""
    tp = tensor_parallel_size
    if tp < 1 or model.num_kv_heads % tp or model.num_attention_heads % tp:
        raise ValueError(
            f"tensor parallel size {tp} does not divide {model.name}'s "
            f"{model.num_attention_heads} attention and {model.num_kv_heads} KV heads"
        )
    return amount / tp
