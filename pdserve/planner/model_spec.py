"""What the capacity math needs to know about a model: its shape, parameter count and dtypes.

A model comes from a built-in preset or from any Hugging Face config.json.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config keys of mixture-of-experts models, whose parameters the Llama-like count gets wrong."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Shapes are counts; `bytes_per_param` and
    `kv_bytes_per_element` are the storage sizes of a weight and of one KV-cache element."""

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
        ModelSpec("smollm2-135m", 30, 3, 9, 64, 576, 1536, 49152, 134_515_008, 4, 4),
    )
}


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
    untied embeddings unless `tie_word_embeddings` says otherwise (Llama's default).
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
    )
    tied = config.get("tie_word_embeddings", False)
    return replace(model, num_params=num_params or count_llama_params(model, tied))


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
