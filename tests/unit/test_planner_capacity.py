"""Capacity math of `pdserve plan`: the seed figures, HF config reading, TP and the command."""

import argparse
import json
from dataclasses import replace

import pytest

from pdserve.core.gpu_spec import GPU_PRESETS, GpuSpec
from pdserve.planner.capacity import (
    decode_step_lower_bound,
    kv_bytes_per_request,
    kv_bytes_per_token,
    max_concurrent_requests,
    plan_capacity,
    prefill_flops,
    prefill_time,
    weight_bytes,
)
from pdserve.planner.command import add_parser
from pdserve.planner.model_spec import MODEL_PRESETS, ModelSpec, count_llama_params, from_hf_config

LLAMA_7B = MODEL_PRESETS["llama-7b"]
A100 = GPU_PRESETS["A100-80GB"]
H100 = GPU_PRESETS["H100-SXM"]

SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def test_seed_7b_fp16_figures():
    assert kv_bytes_per_token(LLAMA_7B) == 512 * 2**10 == 524288
    assert kv_bytes_per_request(LLAMA_7B, 8192) == 4 * 2**30 == 4294967296
    assert weight_bytes(LLAMA_7B) == 14e9
    assert round(decode_step_lower_bound(LLAMA_7B, A100) * 1e3, 1) == 6.9
    assert round(decode_step_lower_bound(LLAMA_7B, H100) * 1e3, 1) == 4.2


def test_seed_gqa_kv_of_four_4k_requests_is_2_gib():
    model = ModelSpec("gqa", 32, 8, 32, 128, 4096, 14336, 128256, 8_000_000_000, 2, 2)
    assert 4 * kv_bytes_per_request(model, 4096) == 2 * 2**30


def test_decode_step_adds_the_batch_kv_to_the_weights():
    batch_kv = 4 * kv_bytes_per_request(LLAMA_7B, 8192)
    expected = (weight_bytes(LLAMA_7B) + batch_kv) / A100.bandwidth_bytes_per_s
    assert decode_step_lower_bound(
        LLAMA_7B, A100, batch_size=4, context_tokens=8192
    ) == pytest.approx(expected)


def test_tensor_parallel_divides_weights_and_kv_per_gpu():
    model = MODEL_PRESETS["llama-3.1-70b"]
    single = decode_step_lower_bound(model, H100, 8, 4096)
    assert decode_step_lower_bound(model, H100, 8, 4096, tensor_parallel_size=4) == pytest.approx(
        single / 4
    )
    assert prefill_time(model, H100, 4096, tensor_parallel_size=8) == pytest.approx(
        prefill_time(model, H100, 4096) / 8
    )
    # Per GPU: 0.9 · 80e9 − 70.55e9 · 2 / 4 bytes left, 2.5 GiB / 4 per 8K-token request.
    assert max_concurrent_requests(model, H100, 8192, tensor_parallel_size=4) == 54
    assert max_concurrent_requests(model, H100, 8192) == 0


def test_tensor_parallel_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match="does not divide"):
        max_concurrent_requests(MODEL_PRESETS["llama-3.1-8b"], H100, 8192, tensor_parallel_size=16)


def test_max_concurrent_requests_counts_whole_requests_after_weights_and_reserve():
    # (0.9 · 80e9 − 14e9) / 4 GiB = 13.5
    assert max_concurrent_requests(LLAMA_7B, A100, 8192) == 13
    assert max_concurrent_requests(LLAMA_7B, A100, 8192, reserve_fraction=0.0) == 15
    tiny = GpuSpec.from_datasheet("tiny", 16, 100, 10)
    assert max_concurrent_requests(LLAMA_7B, tiny, 8192) == 0


def test_plan_refuses_a_model_that_does_not_fit_and_an_oversized_batch():
    with pytest.raises(ValueError, match="does not fit"):
        plan_capacity(MODEL_PRESETS["llama-3.1-70b"], A100)
    with pytest.raises(ValueError, match="exceeds the 13 requests"):
        plan_capacity(LLAMA_7B, A100, batch_size=14)


def test_prefill_time_is_flops_over_achievable_compute():
    flops = 2 * 7e9 * 1000 + 2 * 32 * 1000**2 * 32 * 128
    assert prefill_flops(LLAMA_7B, 1000) == flops
    assert prefill_time(LLAMA_7B, A100, 1000) == pytest.approx(flops / (312e12 * 0.5))


def test_from_hf_config_dict_counts_smollm2_params():
    model = from_hf_config(SMOLLM2_CONFIG, dtype="float32")
    assert model == replace(MODEL_PRESETS["smollm2-135m"], name="hf-config")
    assert model.head_dim == 64 and model.num_params == 134_515_008


def test_from_hf_config_defaults_and_untied_embeddings():
    config = {
        k: v
        for k, v in SMOLLM2_CONFIG.items()
        if k not in ("num_key_value_heads", "tie_word_embeddings")
    }
    model = from_hf_config(config)
    assert model.num_kv_heads == 9
    assert model.bytes_per_param == model.kv_bytes_per_element == 2
    assert model.num_params == count_llama_params(model, tie_word_embeddings=False)
    assert model.num_params - count_llama_params(model, tie_word_embeddings=True) == 49152 * 576


def test_from_hf_config_file_and_folder(tmp_path):
    folder = tmp_path / "SmolLM2-135M"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SMOLLM2_CONFIG, "head_dim": 64}))
    from_file = from_hf_config(folder / "config.json")
    assert from_file == from_hf_config(folder)
    assert from_file.name == "SmolLM2-135M"
    assert kv_bytes_per_token(from_file) == 2 * 30 * 3 * 64 * 2


def test_from_hf_config_reports_a_missing_key():
    with pytest.raises(ValueError, match="lacks 'vocab_size'"):
        from_hf_config({k: v for k, v in SMOLLM2_CONFIG.items() if k != "vocab_size"})


def _run_plan(argv):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_plan_json_reproduces_the_seed(capsys):
    assert _run_plan(["--model", "llama-7b", "--gpu", "A100-80GB", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["weight_bytes"] == 14e9
    assert figures["kv_bytes_per_token"] == 524288
    assert figures["kv_bytes_per_request"] == 4294967296
    assert figures["max_concurrent_requests"] == 13
    assert round(figures["decode_step_lower_bound_ms"], 1) == 6.9


def test_plan_table_for_a_config_json_on_a_custom_gpu(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    argv = [
        "--model",
        str(tmp_path),
        "--gpu-memory-gb",
        "16",
        "--gpu-bandwidth-gbs",
        "100",
        "--gpu-tflops",
        "1",
    ]
    assert _run_plan(argv) == 0
    out = capsys.readouterr().out
    assert "KV per request" in out and "180.00 MiB" in out and " ms" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "neither a preset"),
        (["--model", "llama-7b", "--gpu", "B300"], "unknown GPU preset"),
        (["--model", "llama-7b", "--tensor-parallel-size", "3"], "does not divide"),
        (["--model", "llama-3.1-70b"], "does not fit"),
        (["--model", "llama-7b", "--gpu-memory-gb", "16"], "custom GPU needs"),
    ],
)
def test_plan_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert _run_plan(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and captured.err.count("\n") == 1
