"""MLA models are refused by name at worker start, never later with a layout error: vLLM 0.32's
real MLA cache (MLAAttentionSpec's allocation) matches none of the per-head K/V layouts pdserve
moves. The memory check sizes them (their latent KV: tests/unit/test_planner_moe_mla.py)."""

import pytest

from kv_transfer.attention_support import UnsupportedAttention, check_attention, config_uses_mla
from kv_transfer.kv_layout import LayoutError, find_layout

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


def test_the_worker_start_refuses_an_mla_model_by_name_and_says_why():
    with pytest.raises(UnsupportedAttention) as refused:
        check_attention("deepseek-ai/DeepSeek-V2-Lite", use_mla=True)
    message = str(refused.value)
    assert "deepseek-ai/DeepSeek-V2-Lite" in message
    assert "multi-head latent attention" in message and "per-head K/V" in message
    check_attention("SmolLM2-135M-Instruct", use_mla=False)  # per-head K/V: served


def test_an_mla_config_is_told_by_its_latent_rank():
    assert config_uses_mla(DEEPSEEK_V2_LITE)
    assert config_uses_mla({"text_config": DEEPSEEK_V2_LITE})
    assert not config_uses_mla({"model_type": "llama", "num_key_value_heads": 8})


def test_vllms_mla_cache_matches_no_layout_pdserve_moves():
    """vLLM 0.32's MLAAttentionSpec: one latent (kv_lora_rank + rope dim = 576) per token and
    block, as one "head", no K/V pair: a layout pdserve does not know (the refusal comes first,
    naming the model)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, compute_layer_kv_cache_shape_bytes

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    blocks, heads, tokens, content_bytes = compute_layer_kv_cache_shape_bytes(spec, 10)
    shape = (blocks, heads, tokens, content_bytes // 2)  # the bfloat16 layer view
    assert shape == (10, 1, 16, 576)
    with pytest.raises(LayoutError):
        find_layout(shape, None, 1, 16, 576)
