"""Which models keep multi-head latent attention (MLA) caches, in the words the memory check
(`pdserve up --dry-run`, `pdserve plan`) uses. Torch- and vLLM-free: every pdserve command may
import it.

Workers move MLA caches (kv_transfer/kv_layout.py: one latent per token, kv size 1, replicated
on every TP rank); the memory check does not size them yet (its KV bytes per token count K and V
per KV head), so it refuses such a config by name rather than plan with wrong numbers.
"""


class UnsupportedAttention(ValueError):
    """The model's attention keeps a KV cache the memory check cannot size."""


def mla_refusal(model: str) -> UnsupportedAttention:
    return UnsupportedAttention(
        f"model {model} uses multi-head latent attention (MLA: one compressed latent per token "
        "shared by all heads and replicated on every tensor-parallel rank, not K and V per KV "
        "head): the memory check of pdserve up and pdserve plan sizes only per-head K/V caches "
        "and cannot plan this model yet; its workers serve it (pdserve serve)"
    )


def config_uses_mla(config: dict) -> bool:
    """Whether a Hugging Face config.json describes an MLA model: a latent rank
    (`kv_lora_rank`), on the model or on its text model, as vLLM decides."""
    text = config.get("text_config") or config
    return text.get("kv_lora_rank") is not None
