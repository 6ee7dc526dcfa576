"""The memory check (`pdserve up --dry-run`, `pdserve plan`) refuses an MLA config by name before
sizing it: its KV bytes per token count K and V per KV head, which an MLA model does not keep
(its workers move the latent: tests/unit/test_mla_kv.py)."""

import pytest

from kv_transfer.attention_support import UnsupportedAttention, config_uses_mla
from pdserve.planner.model_spec import from_hf_config

# DeepSeek-V2-Lite's attention: a 512-wide latent and a 64-wide rope key per token.
DEEPSEEK_V2_LITE = {
    "_name_or_path": "deepseek-ai/DeepSeek-V2-Lite",
    "model_type": "deepseek_v2",
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "intermediate_size": 10944,
    "vocab_size": 102400,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "n_routed_experts": 64,
}


def test_the_memory_check_refuses_an_mla_config_before_sizing_it():
    assert config_uses_mla(DEEPSEEK_V2_LITE)
    assert config_uses_mla({"text_config": DEEPSEEK_V2_LITE})
    assert not config_uses_mla({"model_type": "llama", "num_key_value_heads": 8})
    with pytest.raises(UnsupportedAttention, match="DeepSeek-V2-Lite uses multi-head latent"):
        from_hf_config(DEEPSEEK_V2_LITE, num_params=15_700_000_000)
