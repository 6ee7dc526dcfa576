"""Capacity math for one model replica: what fits in GPU memory and how fast a step can go.

Sizes are bytes and times seconds unless a name ends in _ms. A replica is sharded over
`tensor_parallel_size` GPUs, each holding 1/TP of the weights and of the KV cache (attention is
split by heads) and reading its share with its own bandwidth, so TP must divide the heads.
Two exceptions, for DeepSeek-class models: an MLA model's latent KV is one vector per token that
every TP rank keeps whole; and with expert parallelism over `expert_parallel_size` GPUs (a
data-parallel group's DP x TP) each GPU holds 1/EP of the routed experts, the rest of the
weights split by TP. A MoE model computes with its active parameters, not all of them.
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


def expert_weight_bytes(model: ModelSpec) -> int:
    """The routed experts' part of `weight_bytes` (linear weights: quantized as the rest are)."""
    size = QUANTIZED_BYTES.get(model.quantization, model.bytes_per_param)
    return model.expert_params * size


def weight_bytes_per_gpu(
    model: ModelSpec, tensor_parallel_size: int = 1, expert_parallel_size: int = 1
) -> float:
    """One GPU's weights: the routed experts spread over the expert-parallel group's GPUs
    (without EP: each expert split over TP), everything else (attention, shared experts, dense
    MLPs, embeddings) split over TP, so a data-parallel rank at TP 1 holds it whole."""
    experts = expert_weight_bytes(model)
    rest = _per_gpu(weight_bytes(model) - experts, model, tensor_parallel_size)
    return rest + experts / max(expert_parallel_size, tensor_parallel_size)


def kv_bytes_per_token(model: ModelSpec) -> int:
    """One K and one V vector per layer and KV head: 2 · layers · kv_heads · head_dim · bytes;
    with MLA one latent per layer: (kv_lora_rank + qk_rope_head_dim) · layers · bytes
    (DeepSeek-V3: 576 · 61 = 35,136 values, against Llama-3.1-70B's 8 · 128 · 2 · 80 =
    163,840)."""
    if model.mla is not None:
        return model.mla.latent_width * model.num_layers * model.kv_bytes_per_element
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.kv_bytes_per_element


def kv_bytes_per_token_per_gpu(model: ModelSpec, tensor_parallel_size: int = 1) -> float:
    """One GPU's part of a token's KV: 1/TP of its KV heads, or with MLA the whole latent (every
    TP rank keeps the same one: TP buys an MLA model no KV room, data parallelism does)."""
    share = _per_gpu(kv_bytes_per_token(model), model, tensor_parallel_size)
    return kv_bytes_per_token(model) if model.mla is not None else share


def kv_bytes_per_request(model: ModelSpec, context_tokens: int) -> int:
    """KV cache of one request holding `context_tokens` (prompt plus generated tokens)."""
    return kv_bytes_per_token(model) * context_tokens


def kv_budget_bytes(
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    expert_parallel_size: int = 1,
) -> float:
    """Memory per GPU left for KV cache after the reserve and this GPU's share of the weights;
    negative when the weights alone do not fit."""
    weights = weight_bytes_per_gpu(model, tensor_parallel_size, expert_parallel_size)
    return gpu.memory_bytes * (1 - reserve_fraction) - weights


def max_concurrent_requests(
    model: ModelSpec,
    gpu: GpuSpec,
    context_tokens: int,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    expert_parallel_size: int = 1,
) -> int:
    """Requests of `context_tokens` whose KV cache fits in a replica (a data-parallel rank) at
    once (0 if none does). Ignores the rounding of KV to vLLM's blocks, at most one block per
    request."""
    budget = kv_budget_bytes(
        model, gpu, tensor_parallel_size, reserve_fraction, expert_parallel_size
    )
    per_request = kv_bytes_per_token_per_gpu(model, tensor_parallel_size) * context_tokens
    return max(0, math.floor(budget / per_request))


def experts_touched(model: ModelSpec, tokens: int) -> float:
    """The share of a MoE layer's routed experts that at least one of `tokens` is sent to, each
    token to `experts_per_token` of them uniformly at random (real routing is skewed, which only
    lowers it): what a decode step reads of the experts. 1 for a dense model."""
    if model.moe is None:
        return 1.0
    return 1 - (1 - model.moe.experts_per_token / model.moe.num_experts) ** max(tokens, 1)


def decode_step_lower_bound(
    model: ModelSpec,
    gpu: GpuSpec,
    batch_size: int = 1,
    context_tokens: int = 0,
    tensor_parallel_size: int = 1,
    expert_parallel_size: int = 1,
) -> float:
    """Seconds per decode step if memory bandwidth were the only limit.

    A step reads every weight once and the KV cache of every request in the batch once, each GPU
    its share at full bandwidth; compute, kernel launches and all-reduces only add to it. Of a
    MoE model's routed experts it reads those the step's tokens are sent to (`experts_touched`):
    the batch's, and with expert parallelism every data-parallel rank's (EP / TP ranks, each
    taken to run a batch as large). With the defaults (one request, empty context) it is the
    weights-only floor that no batch beats: 14 GB / 2039 GB/s = 6.9 ms for a 7B FP16 model on
    an A100-80GB.
    """
    tp = tensor_parallel_size
    weights = weight_bytes_per_gpu(model, tp, expert_parallel_size)
    experts = expert_weight_bytes(model) / max(expert_parallel_size, tp)
    group_tokens = batch_size * max(1, expert_parallel_size // tp)
    read = weights - experts * (1 - experts_touched(model, group_tokens))
    kv = batch_size * context_tokens * kv_bytes_per_token_per_gpu(model, tp)
    return (read + kv) / gpu.bandwidth_bytes_per_s


def prefill_flops(model: ModelSpec, prompt_tokens: int) -> int:
    """FLOPs to prefill one prompt: a multiply-add (2 FLOPs) per active parameter per token (a
    MoE model's token runs through its experts only), plus causal attention (QKᵀ and AV over the
    lower triangle): 2 · layers · tokens² · heads · head_dim. Counting the embedding lookup as a
    matmul overstates it by a few percent."""
    matmuls = 2 * model.active_params * prompt_tokens
    attention = 2 * model.num_layers * prompt_tokens**2 * model.num_attention_heads * model.head_dim
    return matmuls + attention


def all_to_all_bytes_per_token(model: ModelSpec) -> int:
    """What expert parallelism moves per token, over all MoE layers: its hidden state dispatched
    to each of its `experts_per_token` experts and their outputs combined back, in the model's
    dtype (DeepEP's FP8 dispatch halves the first half). 0 for a dense model."""
    if model.moe is None:
        return 0
    per_layer = 2 * model.moe.experts_per_token * model.hidden_size * model.bytes_per_param
    return model.moe_layers * per_layer


def all_to_all_time(
    model: ModelSpec, tokens: int, expert_parallel_size: int, link_bytes_per_s: float
) -> float:
    """Seconds a step's `tokens` spend in expert parallelism's all-to-all over a GPU's link:
    the share of their experts on other GPUs, 1 - 1/EP, crosses it (none without EP)."""
    if expert_parallel_size <= 1:
        return 0.0
    remote = 1 - 1 / expert_parallel_size
    return tokens * all_to_all_bytes_per_token(model) * remote / link_bytes_per_s


def prefill_time(
    model: ModelSpec, gpu: GpuSpec, prompt_tokens: int, tensor_parallel_size: int = 1
) -> float:
    """Seconds to prefill one prompt at the GPU's achievable share of peak compute."""
    flops = _per_gpu(prefill_flops(model, prompt_tokens), model, tensor_parallel_size)
    return flops / (gpu.peak_flops * gpu.achievable_compute_fraction)


DEFAULT_KV_BANDWIDTH = 25e9  # bytes/s prefill -> decode: a 200 Gb/s NIC
DEFAULT_EP_BANDWIDTH = 50e9  # bytes/s of one GPU's all-to-all: a 400 Gb/s NIC per GPU


@dataclass(frozen=True)
class CapacityPlan:
    """The figures `pdserve plan` prints for one model replica on one GPU type.

    A replica is one data-parallel rank: TP GPUs, its own KV cache and batch; a group of
    `data_parallel_size` of them shares its routed experts over `expert_parallel_size` GPUs
    (1: no expert parallelism). Byte sizes without `_per_gpu` are for the whole model or
    request. The decode lower bound is the weights-only floor (a MoE model's: the experts one
    token reads); the one at batch adds the KV cache of `batch_size` requests each holding
    `context_tokens`, and the experts the group's batches read. Prefill time is for one prompt
    of `context_tokens`. The all-to-all figures are expert parallelism's dispatch and combine
    over `ep_bandwidth` (not in the bounds: DeepSeek overlaps them with compute); the KV
    transfer is one prompt's into a decode replica of this layout (an MLA latent goes to each
    TP rank whole) over `kv_bandwidth`.
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
    data_parallel_size: int
    expert_parallel_size: int
    total_params: int
    active_params: int
    weight_bytes_per_gpu: float
    kv_values_per_token: int  # per layer and head (or latent), summed
    kv_bytes_per_token_per_gpu: float
    kv_tokens_per_gpu: int  # a replica's KV tokens over the GPUs it takes (an MLA latent: / TP)
    kv_transfer_ms: float
    all_to_all_bytes_per_token: int
    all_to_all_prefill_ms: float
    all_to_all_decode_ms: float


def plan_capacity(
    model: ModelSpec,
    gpu: GpuSpec,
    context_tokens: int = 8192,
    batch_size: int | None = None,
    tensor_parallel_size: int = 1,
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    data_parallel_size: int = 1,
    expert_parallel: bool = False,
    kv_bandwidth: float = DEFAULT_KV_BANDWIDTH,
    ep_bandwidth: float = DEFAULT_EP_BANDWIDTH,
) -> CapacityPlan:
    """All figures for one replica; `batch_size` defaults to as many requests as fit.
    Raises ValueError when not even one request fits, the batch does not, or expert
    parallelism is asked of a dense model."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if expert_parallel and model.moe is None:
        raise ValueError(f"{model.name} has no experts to shard: expert parallelism is for MoE")
    ep = dp * tp if expert_parallel else 1
    fits = max_concurrent_requests(model, gpu, context_tokens, tp, reserve_fraction, ep)
    weights = weight_bytes_per_gpu(model, tp, ep)
    kv_per_gpu = kv_bytes_per_token_per_gpu(model, tp)
    if fits == 0:
        usable_gib = gpu.memory_bytes * (1 - reserve_fraction) / GIB
        layout = f"TP {tp}" + (f", EP {ep}" if ep > 1 else "")
        raise ValueError(
            f"{model.name} does not fit on {gpu.name} at {layout}: per GPU, "
            f"{weights / GIB:.2f} GiB of weights plus {kv_per_gpu * context_tokens / GIB:.2f} "
            f"GiB of KV for one {context_tokens}-token request exceed the {usable_gib:.2f} GiB "
            "left after the reserve"
        )
    batch = fits if batch_size is None else batch_size
    if batch > fits:
        raise ValueError(
            f"batch {batch} exceeds the {fits} requests of {context_tokens} tokens that fit"
        )
    budget = kv_budget_bytes(model, gpu, tp, reserve_fraction, ep)
    return CapacityPlan(
        model=model.name,
        gpu=gpu.name,
        tensor_parallel_size=tp,
        context_tokens=context_tokens,
        reserve_fraction=reserve_fraction,
        batch_size=batch,
        weight_bytes=weight_bytes(model),
        kv_bytes_per_token=kv_bytes_per_token(model),
        kv_bytes_per_request=kv_bytes_per_request(model, context_tokens),
        max_concurrent_requests=fits,
        decode_step_lower_bound_ms=1e3
        * decode_step_lower_bound(model, gpu, tensor_parallel_size=tp, expert_parallel_size=ep),
        decode_step_lower_bound_at_batch_ms=1e3
        * decode_step_lower_bound(model, gpu, batch, context_tokens, tp, ep),
        prefill_time_ms=1e3 * prefill_time(model, gpu, context_tokens, tp),
        data_parallel_size=dp,
        expert_parallel_size=ep,
        total_params=model.num_params,
        active_params=model.active_params,
        weight_bytes_per_gpu=weights,
        kv_values_per_token=kv_bytes_per_token(model) // model.kv_bytes_per_element,
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        kv_tokens_per_gpu=math.floor(budget / kv_per_gpu / tp),
        kv_transfer_ms=1e3 * kv_per_gpu * tp * context_tokens / kv_bandwidth,
        all_to_all_bytes_per_token=all_to_all_bytes_per_token(model),
        all_to_all_prefill_ms=1e3 * all_to_all_time(model, context_tokens, ep, ep_bandwidth),
        all_to_all_decode_ms=1e3 * all_to_all_time(model, batch, ep, ep_bandwidth),
    )


def _per_gpu(amount: float, model: ModelSpec, tensor_parallel_size: int) -> float:
    """One GPU's share of `amount` in a TP group; TP splits attention by heads, so it must
    divide both the query and the KV heads (an MLA model's one latent is replicated)."""
    tp = tensor_parallel_size
    split = (model.num_attention_heads,)
    if model.mla is None:
        split += (model.num_kv_heads,)
    if tp < 1 or any(heads % tp for heads in split):
        raise ValueError(
            f"tensor parallel size {tp} does not divide {model.name}'s "
            f"{model.num_attention_heads} attention and {model.num_kv_heads} KV heads"
        )
    return amount / tp
