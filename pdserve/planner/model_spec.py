"""What the capacity math needs to know about a model: its shape, parameter count and dtypes.

A model comes from a built-in preset, a known Hugging Face checkpoint id (a preset's shape and
how its weights are stored, so nothing is downloaded to size it), or any Hugging Face
config.json.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from kv_transfer.attention_support import config_uses_mla, mla_refusal

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

QUANTIZED_BYTES = {"fp8": 1, "fp8_per_tensor": 1, "fp8_per_channel": 1, "fp8_per_block": 1}
"""Bytes per weight of the decoder layers' linear matrices in a quantized model, by vLLM method
("fp8": an fp8 checkpoint; the others quantize a 16-bit one online, each TP shard on its own);
embeddings, the LM head and the norms stay in the model's dtype."""

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config keys of mixture-of-experts models, whose parameters the Llama-like count gets wrong."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Shapes are counts; `bytes_per_param` and
    `kv_bytes_per_element` are the storage sizes of a weight and of one KV-cache element.
    `quantization` ("fp8", a QUANTIZED_BYTES key) stores the decoder layers' linear weights in
    fewer bytes; `tied_embeddings`: the LM head shares the embedding matrix."""

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
    )
}

HUB_CHECKPOINTS = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama-3.1-8b", None),
    "meta-llama/Llama-3.1-70B-Instruct": ("llama-3.1-70b", None),
    # Neural Magic's FP8 checkpoint (compressed-tensors): the linear weights of the decoder
    # layers in FP8, embeddings and LM head in bfloat16.
    "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8": ("llama-3.1-70b", "fp8"),
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
    """A preset by name, else the HF config.json at that path (or in that folder).
    `dtype`, when given, replaces the model's own."""
    if preset_or_path in MODEL_PRESETS:
        model = MODEL_PRESETS[preset_or_path]
        return model.with_dtype(dtype) if dtype else model
    if Path(preset_or_path).exists():
        return from_hf_config(preset_or_path, dtype)
    raise ValueError(
        f"model {preset_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
        "nor an existing config.json"
    )


def from_hf_config(
    config: str | Path | dict, dtype: str | None = None, num_params: int | None = None
) -> ModelSpec:
    """Read a Hugging Face config.json, given as a path (file or folder) or an already-parsed dict.

    As in transformers, `head_dim` defaults to hidden_size / num_attention_heads and
    `num_key_value_heads` to num_attention_heads (no grouped-query attention). `dtype` defaults to
    the config's `torch_dtype` (or `dtype`), else float16. `num_params`, when not given, is
    counted from the shape for a dense Llama-like architecture (see `count_llama_params`), with
    untied embeddings unless `tie_word_embeddings` says otherwise (Llama's default). A
    `quantization_config` sets `quantization` (see `checkpoint_quantization`).
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
    if config_uses_mla(config):  # refused by name here too, as a worker would at start
        raise mla_refusal(name)
    if any(key in config for key in MOE_KEYS) and num_params is None:
        raise ValueError(
            f"{name}: mixture-of-experts config; parameter counting supports dense models only"
        )

    heads = _require(config, "num_attention_heads")
    hidden = _require(config, "hidden_size")
    size = dtype_bytes(dtype or config.get("torch_dtype") or config.get("dtype") or "float16")
    model = ModelSpec(
        name=name,
        num_layers=_require(config, "num_hidden_layers"),
        num_kv_heads=config.get("num_key_value_heads") or heads,
        num_attention_heads=heads,
        head_dim=config.get("head_dim") or hidden // heads,
        hidden_size=hidden,
        intermediate_size=_require(config, "intermediate_size"),
        vocab_size=_require(config, "vocab_size"),
        num_params=0,
        bytes_per_param=size,
        kv_bytes_per_element=size,
        tied_embeddings=config.get("tie_word_embeddings", False),
        quantization=checkpoint_quantization(config),
    )
    return replace(model, num_params=num_params or count_llama_params(model, model.tied_embeddings))


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
    """Parameters of a dense Llama-like model (no biases): token embeddings; per layer the Q, K,
    V and O projections, the gated MLP's three matrices and two RMSNorms; the final norm; and the
    LM head unless it shares the embedding matrix."""
    attention = (
        model.hidden_size * model.head_dim * 2 * (model.num_attention_heads + model.num_kv_heads)
    )
    mlp = 3 * model.hidden_size * model.intermediate_size
    layer = attention + mlp + 2 * model.hidden_size
    embeddings = model.vocab_size * model.hidden_size
    lm_head = 0 if tie_word_embeddings else embeddings
    return embeddings + model.num_layers * layer + model.hidden_size + lm_head


def _require(config: dict, key: str) -> int:
    try:
        return config[key]
    except KeyError:
        raise ValueError(f"config.json lacks {key!r}") from None
