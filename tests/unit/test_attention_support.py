"""An MLA model is told by its config (a latent rank), on the model or its text model, as vLLM
decides: the memory check then sizes its latent (tests/unit/test_planner_moe_mla.py) and its
workers move it (tests/unit/test_mla_kv.py)."""

from kv_transfer.attention_support import config_uses_mla

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


def test_an_mla_config_is_told_by_its_latent_rank():
    assert config_uses_mla(DEEPSEEK_V2_LITE)
    assert config_uses_mla({"text_config": DEEPSEEK_V2_LITE})
    assert not config_uses_mla({"model_type": "llama", "num_key_value_heads": 8})
