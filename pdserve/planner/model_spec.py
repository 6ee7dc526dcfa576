"""What the capacity math needs to know about a model: its shape, parameter count and dtypes.

A model comes from a built-in preset, a known Hugging Face checkpoint id (a preset's shape and
how its weights are stored, so nothing is downloaded to size it), or any Hugging Face
config.json. Dense (Llama-like) models, mixture-of-experts models (Mixtral, Qwen-MoE,
DeepSeek: `Moe`) and multi-head latent attention (DeepSeek-V2/V3: `Mla`) are counted from their
shape: a MoE model's total parameters size its weights, its active ones (the experts a token is
routed to) its compute.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kv_transfer.attention_support import config_uses_mla

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

QUANTIZED_BYTES = {"fp8": 1, "fp8_per_tensor": 1, "fp8_per_channel": 1, "fp8_per_block": 1}
"""Bytes per weight of the decoder layers' linear matrices in a quantized model, by vLLM method
("fp8": an fp8 checkpoint; the others quantize a 16-bit one online, each TP shard on its own);
embeddings, the LM head and the norms stay in the model's dtype."""

MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
"""Config keys giving a mixture-of-experts model's routed experts (DeepSeek, Mixtral, Qwen)."""


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache is one compressed latent of
    `kv_lora_rank` values plus a shared rope key of `qk_rope_head_dim` per token and layer, the
    same for every head (and so on every tensor-parallel rank). `q_lora_rank` 0: queries are
    projected from the hidden state directly (V2-Lite)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0

    @property
    def latent_width(self) -> int:
        """KV values per token and layer: DeepSeek's 512 + 64 = 576."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class Moe:
    """Mixture-of-experts MLPs: each MoE layer routes a token to `experts_per_token` of its
    `num_experts` routed experts (gated MLPs of width `intermediate_size`), plus shared experts
    every token takes (`shared_intermediate_size` in all: DeepSeek's one expert of 2048,
    Mixtral's none). The first `dense_layers` layers keep a dense MLP of the model's
    intermediate size (DeepSeek-V3: 3)."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    shared_intermediate_size: int = 0
    dense_layers: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Shapes are counts; `bytes_per_param` and
    `kv_bytes_per_element` are the storage sizes of a weight and of one KV-cache element.
    `quantization` ("fp8", a QUANTIZED_BYTES key) stores the decoder layers' linear weights in
    fewer bytes; `tied_embeddings`: the LM head shares the embedding matrix. `moe` and `mla`,
    when set, say the MLPs are experts and the attention keeps a latent cache (one KV "head",
    `num_kv_heads` 1); `head_dim` is then a query head's width (nope + rope)."""

    name: str
    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    bytes_per_param: int
    kv_bytes_per_element: int
    tied_embeddings: bool = False
    quantization: str | None = None
    moe: Moe | None = None
    mla: Mla | None = None

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.moe.dense_layers if self.moe else 0

    @property
    def expert_params(self) -> int:
        """The routed experts' parameters: what expert parallelism shards over its GPUs (the
        shared experts, the attention and the rest stay split by TP)."""
        if self.moe is None:
            return 0
        return (
            self.moe_layers
            * self.moe.num_experts
            * 3
            * self.hidden_size
            * self.moe.intermediate_size
        )

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not sent to."""
        if self.moe is None:
            return self.num_params
        unused = self.moe.num_experts - self.moe.experts_per_token
        return self.num_params - self.expert_params * unused // self.moe.num_experts

    @property
    def unquantized_params(self) -> int:
        """What quantization leaves in the model's dtype: the embeddings, the LM head unless it is
        tied, and the norms (two per layer and the final one)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return embeddings + (2 * self.num_layers + 1) * self.hidden_size

    def with_dtype(self, dtype: str) -> "ModelSpec":
        """The same model with weights and KV cache in `dtype` (vLLM keeps the KV cache in the
        model's dtype unless told otherwise)."""
        size = dtype_bytes(dtype)
        return replace(self, bytes_per_param=size, kv_bytes_per_element=size)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


DEEPSEEK_V3_PARAMS = 671_026_404_352  # count_params of its shape: DeepSeek says 671B, 37B active

MODEL_PRESETS = {
    model.name: model
    for model in (
        # The seed's "7B FP16" model: Llama-2-7B's shape with the nominal 7e9 parameters
        # (the exact count is 6.74e9), so the weights are the seed's 14 GB.
        ModelSpec("llama-7b", 32, 32, 32, 128, 4096, 11008, 32000, 7_000_000_000, 2, 2),
        ModelSpec("llama-3.1-8b", 32, 8, 32, 128, 4096, 14336, 128256, 8_030_261_248, 2, 2),
        ModelSpec("llama-3.1-70b", 80, 8, 64, 128, 8192, 28672, 128256, 70_553_706_496, 2, 2),
        # Tied embeddings; float32, as it runs on the CPU test machines.
        ModelSpec(
            "smollm2-135m", 30, 3, 9, 64, 576, 1536, 49152, 134_515_008, 4, 4, tied_embeddings=True
        ),
        # DeepSeek-V3 (and R1, the same architecture): 61 layers of MLA (a 576-wide latent per
        # token and layer), the first 3 with a dense MLP, the other 58 with 256 routed experts
        # (8 per token) and one shared; 671B parameters, 37B active (its config.json).
        ModelSpec(
            "deepseek-v3",
            61,
            1,
            128,
            192,
            7168,
            18432,
            129280,
            DEEPSEEK_V3_PARAMS,
            2,
            2,
            moe=Moe(256, 8, 2048, shared_intermediate_size=2048, dense_layers=3),
            mla=Mla(512, 64, 128, 128, q_lora_rank=1536),
        ),
    )
}

HUB_CHECKPOINTS = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b", None),
    "meta-llama/Llama-3.1-70B-Instruct": ("llama-3.1-70b", None),
    # Neural Magic's FP8 checkpoint (compressed-tensors): the linear weights of the decoder
    # layers in FP8, embeddings and LM head in bfloat16.
    "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8": ("llama-3.1-70b", "fp8"),
    # DeepSeek's own checkpoints are FP8 (128x128 blocks, one float32 scale each: 0.006%
    # more), embeddings, LM head and norms in bfloat16.
    "deepseek-ai/DeepSeek-V3": ("deepseek-v3", "fp8"),
    "deepseek-ai/DeepSeek-V3-0324": ("deepseek-v3", "fp8"),
    "deepseek-ai/DeepSeek-R1": ("deepseek-v3", "fp8"),
    "deepseek-ai/DeepSeek-R1-0528": ("deepseek-v3", "fp8"),
}
"""Hugging Face ids whose size is known here without downloading them: id -> (preset, how its
weights are quantized)."""


def hub_checkpoint(model_id: str) -> ModelSpec | None:
    """The spec of a known Hugging Face id (HUB_CHECKPOINTS), or None."""
    if model_id not in HUB_CHECKPOINTS:
        return None
    preset, quantization = HUB_CHECKPOINTS[model_id]
    return replace(MODEL_PRESETS[preset], name=model_id, quantization=quantization)


def load_model_spec(preset_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A preset by name, a known Hugging Face id (HUB_CHECKPOINTS: its weights quantized as
    the checkpoint's are), else the HF config.json at that path (or in that folder). `dtype`,
    when given, replaces the model's own."""
    known = MODEL_PRESETS.get(preset_or_path) or hub_checkpoint(preset_or_path)
    if known is not None:
        return known.with_dtype(dtype) if dtype else known
    if Path(preset_or_path).exists():
        return from_hf_config(preset_or_path, dtype)
    raise ValueError(
        f"model {preset_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}), a known "
        f"checkpoint ({', '.join(HUB_CHECKPOINTS)}) nor an existing config.json"
    )


def from_hf_config(
    config: str | Path | dict, dtype: str | None = None, num_params: int | None = None
) -> ModelSpec:
    """Read a Hugging Face config.json, given as a path (file or folder) or an already-parsed dict.

    As in transformers, `head_dim` defaults to hidden_size / num_attention_heads and
    `num_key_value_heads` to num_attention_heads (no grouped-query attention). `dtype` defaults to
    the config's `torch_dtype` (or `dtype`), else float16. `num_params`, when not given, is
    counted from the shape (`count_params`: its attention, MLA's included, and its dense or
    expert MLPs), with untied embeddings unless `tie_word_embeddings` says otherwise (Llama's
    default). A `quantization_config` sets `quantization` (see `checkpoint_quantization`).
    """
    if isinstance(config, dict):
        name = config.get("_name_or_path") or "hf-config"
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        name = config.get("_name_or_path") or path.parent.name
    heads = _require(config, "num_attention_heads")
    hidden = _require(config, "hidden_size")
    size = dtype_bytes(dtype or config.get("torch_dtype") or config.get("dtype") or "float16")
    mla = _mla(config)
    model = ModelSpec(
        name=name,
        num_layers=_require(config, "num_hidden_layers"),
        num_kv_heads=1 if mla else config.get("num_key_value_heads") or heads,
        num_attention_heads=heads,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla
        else config.get("head_dim") or hidden // heads,
        hidden_size=hidden,
        intermediate_size=_require(config, "intermediate_size"),
        vocab_size=_require(config, "vocab_size"),
        num_params=0,
        bytes_per_param=size,
        kv_bytes_per_element=size,
        tied_embeddings=config.get("tie_word_embeddings", False),
        quantization=checkpoint_quantization(config),
        moe=_moe(config),
        mla=mla,
    )
    return replace(model, num_params=num_params or count_params(model))


def _mla(config: dict) -> Mla | None:
    """DeepSeek-V2/V3's attention sizes, as vLLM reads them (config_uses_mla: a latent rank)."""
    if not config_uses_mla(config):
        return None
    return Mla(
        kv_lora_rank=config["kv_lora_rank"],
        qk_rope_head_dim=_require(config, "qk_rope_head_dim"),
        qk_nope_head_dim=_require(config, "qk_nope_head_dim"),
        v_head_dim=_require(config, "v_head_dim"),
        q_lora_rank=config.get("q_lora_rank") or 0,
    )


def _moe(config: dict) -> Moe | None:
    """The experts of a DeepSeek (n_routed_experts, n_shared_experts, first_k_dense_replace),
    Mixtral (num_local_experts: every layer's MLP, of intermediate_size) or Qwen-MoE
    (num_experts, moe_intermediate_size, a shared expert in Qwen2-MoE) config."""
    experts = next((config[key] for key in MOE_KEYS if config.get(key)), None)
    if experts is None:
        return None
    width = config.get("moe_intermediate_size") or _require(config, "intermediate_size")
    shared = config.get("n_shared_experts") or 0
    return Moe(
        num_experts=experts,
        experts_per_token=_require(config, "num_experts_per_tok"),
        intermediate_size=width,
        shared_intermediate_size=shared * width
        or config.get("shared_expert_intermediate_size")
        or 0,
        dense_layers=config.get("first_k_dense_replace") or 0,
    )


def checkpoint_quantization(config: dict) -> str | None:
    """How a checkpoint's weights are stored, from its config's `quantization_config`: None
    (unquantized), "fp8" (vLLM's fp8 format, or compressed-tensors with 8-bit float weights), or
    the method's own name, which sizing then refuses (`capacity.weight_bytes`)."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "unknown")
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in quantization.get("config_groups", {}).values()]
        if weights and all(w.get("num_bits") == 8 and w.get("type") == "float" for w in weights):
            return "fp8"
    return method


def count_llama_params(model: ModelSpec, tie_word_embeddings: bool) -> int:
    """Parameters of a dense Llama-like model (no biases): `count_params` with the embeddings
    tied or not."""
    return count_params(replace(model, tied_embeddings=tie_word_embeddings))


def count_params(model: ModelSpec) -> int:
    """Parameters of a decoder-only model (no biases): token embeddings; per layer its attention
    (`attention_params`), its MLP (dense, or the routed experts, the shared ones and the router)
    and two RMSNorms; the final norm; and the LM head unless it shares the embedding matrix."""
    hidden = model.hidden_size
    dense_mlp = 3 * hidden * model.intermediate_size
    mlps = model.num_layers * dense_mlp
    if model.moe is not None:
        moe = model.moe
        sparse = 3 * hidden * moe.shared_intermediate_size + hidden * moe.num_experts
        mlps = moe.dense_layers * dense_mlp + model.moe_layers * sparse + model.expert_params
    layers = model.num_layers * (attention_params(model) + 2 * hidden) + mlps
    embeddings = model.vocab_size * hidden
    lm_head = 0 if model.tied_embeddings else embeddings
    return embeddings + layers + hidden + lm_head


def attention_params(model: ModelSpec) -> int:
    """One layer's attention: the Q, K, V and O projections; with MLA, the query's low-rank
    pair (and its norm), the latent's down projection (with the rope key) and norm, its up
    projection to every head's K (nope part) and V, and the output projection."""
    hidden, heads = model.hidden_size, model.num_attention_heads
    mla = model.mla
    if mla is None:
        return hidden * model.head_dim * 2 * (heads + model.num_kv_heads)
    query = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    if mla.q_lora_rank:
        queries = hidden * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * query
    else:
        queries = hidden * query
    latent = hidden * mla.latent_width + mla.kv_lora_rank
    up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return queries + latent + up + heads * mla.v_head_dim * hidden


def _require(config: dict, key: str) -> int:
    try:
        return config[key]
    except KeyError:
        raise ValueError(f"config.json lacks {key!r}") from None
