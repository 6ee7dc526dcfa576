"""The random-weight models the tests make (seed 0, a few MB each, SmolLM2's tokenizer): small
enough to start an engine fast, shaped so that tensor parallelism 2 divides every sharded size.

- `tiny`: a Llama (2 layers, 4 heads, 2 KV heads), grouped-query attention.
- `tiny-mla`: a DeepSeek-V2 (multi-head latent attention and MoE: 8 routed experts, top 2, one
  shared, the first layer dense). vLLM's CPU MLA kernel takes DeepSeek's real latent width only
  (`kv_lora_rank` 512 + `qk_rope_head_dim` 64 = 576 values per token, block size 16).
- `tiny-moe`: a Qwen3-MoE (8 experts, top 2).
- `tiny-mixtral`: a Mixtral (8 experts, top 2).

The MoE models are saved in bfloat16 and served so (vLLM's CPU MoE path for DeepSeek-V2 refused
float32 weights when tried: "expect weight to be bfloat16, float16").
"""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModel:
    architecture: str  # what config.json's `architectures` names
    summary: str  # what `pdserve model` logs while making it
    dtype: str  # the weights' dtype, the one to serve it in


TINY_MODELS = {
    "tiny": TinyModel("LlamaForCausalLM", "a Llama (2 layers, 4 heads, 2 KV heads)", "float32"),
    "tiny-mla": TinyModel(
        "DeepseekV2ForCausalLM",
        "a DeepSeek-V2 (2 layers, MLA latent 512+64, 8 experts top 2, 1 shared)",
        "bfloat16",
    ),
    "tiny-moe": TinyModel(
        "Qwen3MoeForCausalLM", "a Qwen3-MoE (2 layers, 8 experts top 2)", "bfloat16"
    ),
    "tiny-mixtral": TinyModel(
        "MixtralForCausalLM", "a Mixtral (2 layers, 8 experts top 2)", "bfloat16"
    ),
}

# What every tiny model shares. initializer_range 0.2, not 0.02: with tiny weights every prompt
# gave one token repeated, and a test could not tell a right KV cache from a wrong one.
COMMON = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,
}


def _config(name: str, tokenizer, eos_token_id: int):
    import transformers

    shared = {
        **COMMON,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos_token_id,
        "architectures": [TINY_MODELS[name].architecture],
    }
    experts = {"num_experts_per_tok": 2}
    if name == "tiny":
        # head_dim 64: vLLM's CPU attention refuses 16 ("Unsupported CPU attention configuration")
        return transformers.LlamaConfig(
            **shared, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True
        )
    if name == "tiny-mla":
        return transformers.DeepseekV2Config(
            **shared,
            **experts,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=256,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,  # vLLM's CPU router groups experts even for "greedy"
            topk_group=1,
            tie_word_embeddings=False,
        )
    if name == "tiny-moe":
        return transformers.Qwen3MoeConfig(
            **shared,
            **experts,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            moe_intermediate_size=256,
            tie_word_embeddings=True,
        )
    return transformers.MixtralConfig(
        **shared, **experts, num_key_value_heads=2, head_dim=64, num_local_experts=8
    )


def make_tiny(name: str, work: Path, tokenizer_source: Path, log, eos_token_id: int) -> None:
    """Write tiny model `name` into `work` (random weights, seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = TINY_MODELS[name]
    log(f"{name}: making {model.summary} with random weights, seed 0")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = _config(name, tokenizer, eos_token_id)
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config).to(getattr(torch, model.dtype))
    weights.save_pretrained(work, safe_serialization=True)
    tokenizer.save_pretrained(work)
