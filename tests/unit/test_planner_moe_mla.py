"""The capacity math for DeepSeek-class models: a MoE model's total parameters size its weights
and its active ones its compute, expert parallelism shards the routed experts (and moves each
token's hidden state to its experts and back), and an MLA model's KV is one latent per token
and layer that every tensor-parallel rank keeps whole. Figures for DeepSeek-V3/R1 against
Llama-3.1-70B, which docs/deepseek.md quotes."""

import json
from dataclasses import asdict, replace

import pytest

from pdserve.cluster.placement import model_shape
from pdserve.core.gpu_spec import GPU_PRESETS
from pdserve.core.kinds import Role
from pdserve.planner.capacity import (
    GIB,
    all_to_all_bytes_per_token,
    all_to_all_time,
    decode_step_lower_bound,
    experts_touched,
    kv_bytes_per_token,
    kv_bytes_per_token_per_gpu,
    plan_capacity,
    prefill_flops,
    weight_bytes,
    weight_bytes_per_gpu,
)
from pdserve.planner.cluster_file import cluster_document
from pdserve.planner.cost_model import RooflineCost
from pdserve.planner.memory_fit import gpu_memory_use
from pdserve.planner.model_spec import MODEL_PRESETS, count_params, from_hf_config, hub_checkpoint
from pdserve.planner.search import Candidate, RooflineHardware
from pdserve.settings.cluster_file import parse_cluster
from tests.unit.test_planner_capacity import _run_plan

H100 = GPU_PRESETS["H100-SXM"]
H200 = GPU_PRESETS["H200"]
DEEPSEEK = hub_checkpoint("deepseek-ai/DeepSeek-R1")  # FP8, as DeepSeek ships it
LLAMA_70B = MODEL_PRESETS["llama-3.1-70b"]

# deepseek-ai/DeepSeek-V3's config.json, the keys the planner reads.
DEEPSEEK_V3_CONFIG = {
    "_name_or_path": "deepseek-ai/DeepSeek-V3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
# mistralai/Mixtral-8x7B-v0.1's: 46.7B parameters, 12.9B active (Mistral's figures).
MIXTRAL_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}


def test_deepseek_v3_is_671b_parameters_37b_active_counted_from_its_config():
    model = from_hf_config(DEEPSEEK_V3_CONFIG)
    assert model == replace(DEEPSEEK, name="deepseek-ai/DeepSeek-V3")
    assert count_params(MODEL_PRESETS["deepseek-v3"]) == DEEPSEEK.num_params
    assert round(DEEPSEEK.num_params / 1e9) == 671
    assert round(DEEPSEEK.active_params / 1e9, 1) == 37.6
    assert DEEPSEEK.expert_params == 58 * 256 * 3 * 7168 * 2048  # 58 MoE layers: 97% of it all
    # FP8 linear weights, bfloat16 embeddings, LM head and norms: 626.7 GiB.
    assert round(weight_bytes(DEEPSEEK) / GIB, 1) == 626.7


def test_mixtral_is_46_7b_parameters_12_9b_active():
    model = from_hf_config(MIXTRAL_CONFIG)
    assert model.mla is None and model.moe.num_experts == 8 and model.moe.dense_layers == 0
    assert round(model.num_params / 1e9, 1) == 46.7
    assert round(model.active_params / 1e9, 1) == 12.9


def test_mla_kv_is_576_values_per_layer_one_copy_per_rank_against_gqa_70b():
    assert kv_bytes_per_token(DEEPSEEK) == 576 * 61 * 2 == 70_272  # 35,136 bfloat16 values
    assert kv_bytes_per_token(LLAMA_70B) == 8 * 128 * 2 * 80 * 2 == 327_680  # 163,840 values
    # GQA splits its KV heads over TP; every rank keeps the whole latent.
    assert kv_bytes_per_token_per_gpu(LLAMA_70B, 4) == 327_680 / 4
    assert kv_bytes_per_token_per_gpu(DEEPSEEK, 8) == 70_272
    # TP only has to divide the attention heads (128) for MLA, not its one latent.
    with pytest.raises(ValueError, match="does not divide"):
        kv_bytes_per_token_per_gpu(DEEPSEEK, 3)


def test_expert_parallelism_shards_the_experts_and_tp_the_rest():
    experts = DEEPSEEK.expert_params  # FP8: a byte each
    rest = weight_bytes(DEEPSEEK) - experts
    assert weight_bytes_per_gpu(DEEPSEEK, 1, 16) == rest + experts / 16
    assert weight_bytes_per_gpu(DEEPSEEK, 2, 32) == rest / 2 + experts / 32
    assert weight_bytes_per_gpu(DEEPSEEK, 8) == weight_bytes(DEEPSEEK) / 8  # no EP: all over TP
    assert round(weight_bytes_per_gpu(DEEPSEEK, 1, 16) / GIB, 2) == 55.73
    assert round(weight_bytes_per_gpu(DEEPSEEK, 1, 32) / GIB, 2) == 36.70
    dense = MODEL_PRESETS["llama-3.1-8b"]
    assert weight_bytes_per_gpu(dense, 2, 8) == weight_bytes(dense) / 2  # no experts to shard


def test_compute_counts_the_active_parameters_and_a_step_reads_the_experts_it_touches():
    assert prefill_flops(DEEPSEEK, 1000) == 2 * DEEPSEEK.active_params * 1000 + (
        2 * 61 * 1000**2 * 128 * 192
    )
    assert experts_touched(DEEPSEEK, 1) == 8 / 256
    assert experts_touched(DEEPSEEK, 1000) == pytest.approx(1.0)
    assert experts_touched(LLAMA_70B, 1) == 1.0
    # One token reads the attention and 8 of 256 experts; a big batch reads them all.
    lone = decode_step_lower_bound(DEEPSEEK, H100, 1, 0, 1, 32)
    busy = decode_step_lower_bound(DEEPSEEK, H100, 256, 0, 1, 32)
    assert lone < busy <= weight_bytes_per_gpu(DEEPSEEK, 1, 32) / H100.bandwidth_bytes_per_s


def test_the_all_to_all_moves_each_tokens_hidden_state_to_its_experts_and_back():
    assert all_to_all_bytes_per_token(DEEPSEEK) == 58 * 2 * 8 * 7168 * 2
    assert all_to_all_bytes_per_token(LLAMA_70B) == 0
    assert all_to_all_time(DEEPSEEK, 100, 1, 50e9) == 0.0  # no EP: nothing crosses a link
    on_16 = all_to_all_time(DEEPSEEK, 100, 16, 50e9)
    assert on_16 == pytest.approx(100 * all_to_all_bytes_per_token(DEEPSEEK) * 15 / 16 / 50e9)
    assert all_to_all_time(DEEPSEEK, 100, 32, 50e9) > on_16  # fewer experts stay local


def test_the_roofline_cost_adds_the_all_to_all_under_expert_parallelism():
    alone = RooflineCost(DEEPSEEK, H100, 1, 32, expert_parallel=False)
    wide = RooflineCost(DEEPSEEK, H100, 1, 32, expert_parallel=True)
    assert wide.expert_parallel_size == 32 and alone.expert_parallel_size == 1
    compute = 2 * DEEPSEEK.active_params * 64 / (H100.peak_flops * H100.achievable_compute_fraction)
    memory = decode_step_lower_bound(DEEPSEEK, H100, 64, 4096, 1, 32)
    assert wide.decode_time([4096] * 64) == pytest.approx(
        max(compute, memory) + all_to_all_time(DEEPSEEK, 64, 32, 50e9)
    )
    assert wide.prefill_time([2048]) == pytest.approx(
        alone.prefill_time([2048]) + all_to_all_time(DEEPSEEK, 2048, 32, 50e9)
    )


def test_the_memory_check_counts_experts_per_ep_rank():
    use = gpu_memory_use(
        Role.DECODE, DEEPSEEK, H100, 1, 28 * GIB, 256, data_parallel_size=32, expert_parallel=True
    )
    assert use.weights == weight_bytes_per_gpu(DEEPSEEK, 1, 32) and use.fits
    assert use.describe().startswith("decode TP 1 x DP 32, EP 32 on H100-SXM: weights 36.70")
    without = gpu_memory_use(Role.DECODE, DEEPSEEK, H100, 1, 28 * GIB, 256, data_parallel_size=32)
    assert not without.fits  # each rank would hold every expert


def test_the_search_sizes_an_mla_decode_pool_by_its_whole_latent():
    hardware = RooflineHardware(DEEPSEEK, H200, 25e9, 1e-3)
    cluster = hardware.cluster(Candidate(1, 8, 1, 8))
    per_gpu_gib = cluster.kv_capacity_tokens * 70_272 / GIB
    assert 1 <= per_gpu_gib <= H200.memory_bytes / GIB  # one GPU's budget, not eight
    assert cluster.kv_bytes_per_token == 8 * 70_272  # a latent to each of 8 decode ranks
    assert 16 in hardware.tensor_parallel_sizes(16)  # TP divides its 128 heads


def test_plan_shows_what_wide_ep_buys_per_gpu(capsys):
    """DP 32 x EP 32 against TP 8 on H200s: every rank's KV is its own (TP 8 keeps 8 copies of
    the latent) and the experts spread 32 ways."""
    argv = ["--model", "deepseek-ai/DeepSeek-R1", "--gpu", "H200", "--json"]
    assert _run_plan([*argv, "--tensor-parallel-size", "8"]) == 0
    tp8 = json.loads(capsys.readouterr().out)
    assert _run_plan([*argv, "--data-parallel-size", "32", "--expert-parallel"]) == 0
    ep32 = json.loads(capsys.readouterr().out)
    assert tp8["kv_values_per_token"] == ep32["kv_values_per_token"] == 35_136
    assert ep32["expert_parallel_size"] == 32 and tp8["expert_parallel_size"] == 1
    assert ep32["weight_bytes_per_gpu"] < tp8["weight_bytes_per_gpu"] / 1.5
    assert ep32["kv_tokens_per_gpu"] > 5 * tp8["kv_tokens_per_gpu"]
    assert ep32["all_to_all_bytes_per_token"] == all_to_all_bytes_per_token(DEEPSEEK)
    assert tp8["active_params"] == ep32["active_params"] == DEEPSEEK.active_params
    assert _run_plan(["--model", "deepseek-ai/DeepSeek-R1", "--gpu", "H100-SXM",
                      "--data-parallel-size", "32", "--expert-parallel"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    for line in (
        "parameters               671.0B, 37.6B active per token",
        "weights per GPU          36.70 GiB",
        "KV per token             68.62 KiB  (35,136 values)",
        "all-to-all per token     12.69 MiB  (all MoE layers)",
    ):
        assert line in table


def test_plan_refuses_expert_parallelism_for_a_dense_model(capsys):
    assert _run_plan(["--model", "llama-3.1-8b", "--data-parallel-size", "2", "--expert-parallel"])
    assert "no experts to shard" in capsys.readouterr().err
    figures = asdict(plan_capacity(LLAMA_70B, H100, tensor_parallel_size=4))
    assert figures["all_to_all_bytes_per_token"] == 0 and figures["expert_parallel_size"] == 1


def test_a_planned_cluster_file_names_a_known_checkpoint_by_its_id():
    document = cluster_document(Candidate(1, 8, 1, 8), "deepseek-ai/DeepSeek-R1", "auto", "H200")
    assert document["model"] == {"path": "deepseek-ai/DeepSeek-R1", "dtype": "auto"}
    config = parse_cluster(document)
    assert model_shape(config) == DEEPSEEK  # `up` sizes it without a preset or a download
