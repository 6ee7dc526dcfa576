"""Which attention KV caches pdserve moves between workers, and the refusal of the others, in
the words both the worker start (the connectors) and the memory check (`pdserve up --dry-run`,
`pdserve plan`) use. Torch- and vLLM-free: every pdserve command may import it.

Supported: per-head K and V caches (multi-head, grouped-query and multi-query attention), in
the layer views of kv_layout.KNOWN_LAYOUTS, KV heads sharded or replicated over TP as vLLM
does. Refused: multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2 and the like), whose
cache is one compressed latent per token (vLLM 0.32's MLAAttentionSpec: [blocks, 1, tokens,
kv_lora_rank + rope dim], no separate V), the same on every TP rank. Moving it needs its own
route (one prefill rank sends, every decode rank receives), which pdserve does not have yet:
such a model fails at worker start by name, never later with a layout error.
"""


class UnsupportedAttention(ValueError):
    """The model's attention keeps a KV cache pdserve cannot move."""


def mla_refusal(model: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"model {model} uses multi-head latent attention (MLA: one compressed latent per token "
        "shared by all heads and replicated on every tensor-parallel rank, not K and V per KV "
        "head): pdserve moves only per-head K/V caches (multi-head, grouped-query, multi-query "
        "attention), so it cannot run this model as a prefill, decode or flex worker; serve it "
        "colocated or with vLLM alone"
    )


def check_attention(model: str, use_mla: bool) -> None:
    """At worker start: refuse a model whose KV cache pdserve cannot move (vLLM's
    `ModelConfig.use_mla` says whether it keeps the latent cache)."""
    if use_mla:
        raise mla_refusal(model)


def config_uses_mla(config: dict) -> bool:
    """Whether a Hugging Face config.json describes an MLA model: a latent rank
    (`kv_lora_rank`), on the model or on its text model, as vLLM decides."""
    text = config.get("text_config") or config
    return text.get("kv_lora_rank") is not None
