"""Which models keep multi-head latent attention (MLA) caches, in the words the memory check
(`pdserve up --dry-run`, `pdserve plan`) uses. Torch- and vLLM-free: every pdserve command may
import it.

An MLA cache is one latent per token (DeepSeek-V3: 512 + 64 = 576 values a layer), the same on
every tensor-parallel rank: workers move it as one head with kv size 1 (kv_transfer/kv_layout.py)
and the memory check sizes it so (pdserve/planner/model_spec.py).
"""


def config_uses_mla(config: dict) -> bool:
    """Whether a Hugging Face config.json describes an MLA model: a latent rank
    (`kv_lora_rank`), on the model or on its text model, as vLLM decides."""
    text = config.get("text_config") or config
    return text.get("kv_lora_rank") is not None
