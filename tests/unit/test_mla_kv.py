"""Multi-head latent attention's KV (DeepSeek-V2/V3, Kimi-K2) as pdserve moves it: one latent per
token (kv_lora_rank 512 + rope 64 = 576 values), no V, the same on every tensor-parallel rank, so
one "head" of kv size 1. Checked against vLLM's own pieces: its MLAAttentionSpec's layer view
(bfloat16, fp8 as 576 uint8 a token, and the 656-byte sparse-MLA packing pdserve does not move),
and its engine config for a DeepSeek-V3-shaped config.json (no weights, no engine started): the
worker's KV shape, its compatibility handshake and the largest slice it accepts."""

import json

import pytest
import torch

from kv_transfer.compatibility import compatibility_of, max_slice_bytes
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout, LayoutError, find_layout

LATENT, BLOCK_SIZE, BLOCKS = 576, 16, 10

# DeepSeek-V3's attention and depth (671B, 61 layers, 128 heads): enough for vLLM's ModelConfig.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}


def mla_view(cache_dtype: str) -> torch.Tensor:
    """A layer's cache as vLLM 0.32 hands it to a connector for MLA with `cache_dtype`: the
    [B, H, N, C] view of its MLAAttentionSpec (the spec made as MLAAttention makes it)."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec,
        compute_layer_kv_cache_shape_bytes,
        get_kv_quant_mode,
    )

    dtype = torch.bfloat16 if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    spec = MLAAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=LATENT,
        dtype=dtype,
        cache_dtype_str=cache_dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes={"fp8_ds_mla": 656}.get(cache_dtype),
    )
    blocks, heads, tokens, content_bytes = compute_layer_kv_cache_shape_bytes(spec, BLOCKS)
    return torch.zeros(blocks, heads, tokens, content_bytes // dtype.itemsize, dtype=dtype)


@pytest.mark.parametrize(("cache_dtype", "element"), [("auto", 2), ("fp8", 1)])
def test_vllms_mla_cache_is_one_latent_head_of_kv_size_1_viewed_in_wire_order(cache_dtype, element):
    cache = mla_view(cache_dtype)
    assert tuple(cache.shape) == (BLOCKS, 1, BLOCK_SIZE, LATENT)
    assert cache.element_size() == element  # fp8: vLLM's uint8 storage, 576 B a token
    layout = find_layout(tuple(cache.shape), None, 1, BLOCK_SIZE, LATENT, kv_size=1)
    assert layout == LayerLayout((BLOCK, HEAD, TOKEN, CONTENT), kv_size=1)
    wire = layout.canonical(cache, LATENT)
    assert tuple(wire.shape) == (BLOCKS, 1, BLOCK_SIZE, 1, LATENT)
    assert wire.data_ptr() == cache.data_ptr()  # a view: the cache itself
    wire[3, 0, 5, 0, 7] = 1
    assert cache[3, 0, 5, 7] == 1
    with pytest.raises(LayoutError):  # read as K and V it matches nothing
        find_layout(tuple(cache.shape), None, 1, BLOCK_SIZE, LATENT)


def test_sparse_mlas_packed_fp8_cache_matches_no_layout_and_is_refused_by_name():
    """DeepSeek-V3.2's fp8_ds_mla packs 656 bytes a token (scales beside the latent), and its
    indexer keeps caches of another shape in other layers: refused when the caches register."""
    from kv_transfer.connector_base import KvCaches, KvShape  # imports vLLM

    cache = mla_view("fp8_ds_mla")
    assert tuple(cache.shape) == (BLOCKS, 1, BLOCK_SIZE, 656)
    with pytest.raises(LayoutError, match="an MLA latent"):
        find_layout(tuple(cache.shape), None, 1, BLOCK_SIZE, LATENT, kv_size=1)
    shape = KvShape(BLOCK_SIZE, LATENT, 1, 1, 1, 1)
    latent = mla_view("auto")
    caches = KvCaches.of({"model.layers.0.attn": latent, "model.layers.1.attn": latent}, shape)
    assert caches.layout.kv_size == 1 and caches.index == {
        "model.layers.0.attn": 0,
        "model.layers.1.attn": 1,
    }
    indexer = torch.zeros(BLOCKS, 1, BLOCK_SIZE, 132, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="model.layers.1.indexer.*caches of one shape"):
        KvCaches.of({"model.layers.0.attn": latent, "model.layers.1.indexer": indexer}, shape)


def engine_config(folder, tp: int, kv_cache_dtype: str = "auto"):
    """vLLM's engine config for the DeepSeek-V3-shaped model at tensor parallelism `tp` (vLLM's
    CPU platform picks the MLA block: 16 tokens, 128 on a CPU with AMX, vllm/platforms/cpu.py)."""
    from vllm.engine.arg_utils import EngineArgs

    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return EngineArgs(
        model=str(folder),
        dtype="bfloat16",
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype,
        skip_tokenizer_init=True,
        max_model_len=4096,
    ).create_engine_config()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_deepseek_engine_moves_one_replicated_latent_head_whatever_its_tp(tmp_path, tp):
    from kv_transfer.connector_base import KvShape  # imports vLLM

    config = engine_config(tmp_path, tp)
    assert config.model_config.get_total_num_kv_heads() == 128  # vLLM counts the attention's
    block_size = config.cache_config.block_size
    assert block_size in (16, 128)
    assert KvShape.of(config) == KvShape(
        block_size=block_size,
        head_size=LATENT,
        total_kv_heads=1,
        rank_kv_heads=1,
        tp=tp,
        kv_size=1,
    )
    compatibility = compatibility_of(config)
    assert (compatibility.total_kv_heads, compatibility.head_size) == (1, LATENT)
    assert compatibility.bytes_per_head_token == LATENT * 2  # one bfloat16 latent, no V
    # The largest layer slice: one latent per token of the longest request, not 128 heads' K/V.
    assert max_slice_bytes(compatibility, 4096) == 4096 * LATENT * 2


def test_an_fp8_latent_is_576_bytes_a_token_and_says_so_in_the_handshake(tmp_path):
    bf16, fp8 = engine_config(tmp_path, 2), engine_config(tmp_path, 2, "fp8")
    ours = compatibility_of(fp8)
    assert (ours.dtype, ours.bytes_per_head_token, ours.kv_scale_mode) == (
        "fp8_e4m3",
        LATENT,
        "fp8_per_tensor",
    )
    assert ours.fingerprint() != compatibility_of(bf16).fingerprint()
    layers = DEEPSEEK_V3["num_hidden_layers"]  # KV bytes a token: 576 values x 61 layers
    assert compatibility_of(bf16).bytes_per_head_token * layers == 70_272
    assert ours.bytes_per_head_token * layers == 35_136
