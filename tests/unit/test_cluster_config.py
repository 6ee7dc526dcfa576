"""Cluster files: schema validation, head-layout, GPU-memory and resource checks, and `pdserve
up` refusing a bad file before anything starts. No engine, no Ray."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml

from pdserve import cli
from pdserve.cluster.placement import (
    check_layout,
    check_memory,
    check_resources,
    memory_use,
    model_shape,
    worker_slots,
)
from pdserve.planner.capacity import GIB
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file, parse_cluster

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "clusters"


def refused(document) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_cluster(document)
    return str(caught.value)


def test_an_empty_file_takes_the_defaults():
    config = parse_cluster(None)
    assert (config.prefill.replicas, config.decode.replicas) == (1, 1)
    assert config.registry.embedded and config.transport.kind == "auto"


@pytest.mark.parametrize(
    "document, message",
    [
        ({"prefil": {}}, "prefil: unknown field"),
        ({"prefill": {"replica": 2}}, "prefill.replica: unknown field"),
        ({"prefill": {"replicas": "two"}}, "prefill.replicas: must be an integer, got str 'two'"),
        ({"prefill": {"replicas": True}}, "prefill.replicas: must be an integer, got bool True"),
        ({"decode": {"replicas": 0}}, "decode.replicas: must be an integer >= 1, got 0"),
        (
            {"prefill": {"tensor_parallel_size": 0}},
            "prefill.tensor_parallel_size: must be an integer >= 1",
        ),
        ({"decode": {"gpu_type": "V100"}}, "decode.gpu_type: must be one of cpu, "),
        (
            {"transport": {"kind": "rdma"}},
            "transport.kind: must be one of auto, grpc, nccl, shm, got 'rdma'",
        ),
        ({"router": {"policy": "random"}}, "router.policy: must be one of"),
        ({"registry": {"url": "http://x"}}, "registry.url: must start with redis://"),
        ({"registry": {"embedded": False}}, "registry: give a url, or embedded: true"),
        ({"model": "smollm2"}, "model: must be a mapping, got str 'smollm2'"),
        ({"transport": {"kv_timeout_s": -1}}, "transport.kv_timeout_s: must be > 0"),
        ({"name": "a b"}, "name: letters, digits and '-' only"),
        ([1, 2], "the file: must be a mapping"),
    ],
)
def test_a_bad_field_is_refused_by_name(document, message):
    assert message in refused(document)


def test_numbers_are_accepted_where_floats_are_expected():
    assert parse_cluster({"engine": {"kv_cache_gib": 1}}).engine.kv_cache_gib == 1.0


def kv_cache_gib_by_role(config) -> dict[str, float]:
    return {role: config.worker_settings(role, "").engine.kv_cache_gib for role in config.pools()}


def test_kv_cache_gib_is_set_per_pool_and_engine_kv_cache_gib_stays_the_default_of_both():
    assert kv_cache_gib_by_role(parse_cluster({"engine": {"kv_cache_gib": 8}})) == {
        "prefill": 8.0,
        "decode": 8.0,
    }
    per_pool = parse_cluster(
        {"engine": {"kv_cache_gib": 8}, "prefill": {"kv_cache_gib": 16}, "decode": {}}
    )
    assert kv_cache_gib_by_role(per_pool) == {"prefill": 16.0, "decode": 8.0}
    assert kv_cache_gib_by_role(parse_cluster({"decode": {"kv_cache_gib": 30}})) == {
        "prefill": 2.0,  # the engine's default
        "decode": 30.0,
    }
    flex = parse_cluster({"flex": {"replicas": 2, "kv_cache_gib": 4}})
    assert kv_cache_gib_by_role(flex) == {"flex": 4.0}
    assert "decode.kv_cache_gib: must be > 0" in refused({"decode": {"kv_cache_gib": 0}})


def test_the_kv_pool_is_each_nodes_for_its_workers_and_can_be_turned_off():
    config = parse_cluster({"kv_pool": {"gib": 0.5}, "prefill": {"tensor_parallel_size": 2}})
    assert config.kv_pool.budget_bytes == 2**29
    wants = {role: config.worker_settings(role, "").wants_kv_pool for role in config.pools()}
    assert wants == {"prefill": True, "decode": True}
    flex = parse_cluster({"flex": {"replicas": 2}})
    assert flex.worker_settings("flex", "").wants_kv_pool
    off = parse_cluster({"kv_pool": {"enabled": False}})
    assert off.kv_pool.budget_bytes == 0
    assert not off.worker_settings("prefill", "").wants_kv_pool
    assert "kv_pool.gib: must be > 0" in refused({"kv_pool": {"gib": 0}})


H100_70B = {"path": "meta-llama/Llama-3.1-70B-Instruct", "dtype": "bfloat16"}


def test_each_gpu_pool_is_sized_per_gpu_from_its_tp_and_kv_cache():
    config = parse_cluster(
        {
            "model": H100_70B,
            "prefill": {"tensor_parallel_size": 4, "gpu_type": "H100-SXM", "kv_cache_gib": 16},
            "decode": {"tensor_parallel_size": 4, "gpu_type": "H100-SXM", "kv_cache_gib": 30},
        }
    )
    prefill, decode = memory_use(config, model_shape(config))
    # 70.55e9 bfloat16 parameters over 4 GPUs; 10% of 80 GB; a 256 MiB send budget per prefill
    # rank, a 1 GiB inbox per decode rank.
    assert prefill.weights == decode.weights == 70_553_706_496 * 2 / 4
    assert (prefill.kv_cache, decode.kv_cache) == (16 * GIB, 30 * GIB)
    assert prefill.activations == decode.activations == 8e9
    assert (prefill.buffers, decode.buffers) == (256 << 20, 1 << 30)
    check_memory([prefill, decode])
    assert decode.describe() == (
        "decode TP 4 on H100-SXM: weights 32.85 + KV 30.00 + activations 7.45 + KV buffers "
        "1.00 = 71.30 GiB per GPU of 74.51 GiB (80 GB)"
    )


def test_a_pool_that_does_not_fit_its_gpus_is_refused_naming_the_numbers():
    config = parse_cluster(
        {
            "model": H100_70B,
            "prefill": {"replicas": 0},
            "decode": {"tensor_parallel_size": 2, "gpu_type": "H100-SXM", "kv_cache_gib": 4},
        }
    )
    with pytest.raises(ConfigError) as caught:
        check_memory(memory_use(config, model_shape(config)))
    assert str(caught.value).startswith(
        "does not fit in GPU memory: decode TP 2 on H100-SXM: weights 65.71 + KV 4.00 + "
        "activations 7.45 + KV buffers 1.00 = 78.16 GiB per GPU of 74.51 GiB (80 GB), 3.65 GiB "
        "over"
    )


def test_cpu_pools_have_no_gpu_memory_to_check():
    config = parse_cluster({"engine": {"kv_cache_gib": 1000}})
    assert memory_use(config, MODEL_PRESETS["smollm2-135m"]) == []


def test_weights_are_sized_at_the_checkpoint_quantization_or_the_online_one():
    fp8_checkpoint = parse_cluster(
        {
            "model": {"path": "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", "dtype": "bfloat16"},
            "decode": {"gpu_type": "H100-SXM"},
            "prefill": {"replicas": 0},
        }
    )
    (decode,) = memory_use(fp8_checkpoint, model_shape(fp8_checkpoint))
    assert round(decode.weights / GIB, 2) == 67.67  # FP8 layers, bfloat16 embeddings and head
    online = parse_cluster(
        {
            "model": {**H100_70B, "quantization": "fp8_per_tensor"},
            "decode": {"gpu_type": "H100-SXM"},
            "prefill": {"replicas": 0},
        }
    )
    assert memory_use(online, model_shape(online))[0].weights == decode.weights
    unknown = parse_cluster(
        {
            "model": {**H100_70B, "quantization": "awq"},
            "decode": {"gpu_type": "H100-SXM"},
            "prefill": {"replicas": 0},
        }
    )
    with pytest.raises(ConfigError, match="cannot size weights quantized with 'awq'"):
        memory_use(unknown, model_shape(unknown))


def test_tensor_parallelism_must_divide_the_heads():
    smollm2 = MODEL_PRESETS["smollm2-135m"]  # 9 attention heads, 3 KV heads
    decode_only = parse_cluster({"prefill": {"replicas": 0}, "decode": {"tensor_parallel_size": 2}})
    with pytest.raises(
        ConfigError,
        match="decode.tensor_parallel_size: 2 does not divide the model's 9 attention heads",
    ):
        check_layout(decode_only, smollm2)
    check_layout(parse_cluster({"prefill": {"replicas": 0}}), smollm2)
    both_three = parse_cluster(
        {"prefill": {"tensor_parallel_size": 3}, "decode": {"tensor_parallel_size": 3}}
    )
    check_layout(both_three, smollm2)  # 3 divides 9 and 3
    with pytest.raises(ConfigError, match="3 does not divide the model's 64 attention heads"):
        check_layout(both_three, MODEL_PRESETS["llama-3.1-70b"])


def test_prefill_and_decode_pools_may_run_at_different_tensor_parallel_sizes():
    config = parse_cluster(
        {"prefill": {"tensor_parallel_size": 1}, "decode": {"tensor_parallel_size": 4}}
    )
    check_layout(config, MODEL_PRESETS["llama-3.1-70b"])


def test_kv_heads_fewer_than_tp_are_replicated_as_vllm_does_but_must_divide_it():
    tiny = replace(MODEL_PRESETS["smollm2-135m"], num_attention_heads=12, num_kv_heads=2)
    check_layout(parse_cluster({"decode": {"tensor_parallel_size": 4}}), tiny)
    with pytest.raises(ConfigError, match="3 neither divides nor is a multiple of"):
        check_layout(parse_cluster({"decode": {"tensor_parallel_size": 3}}), tiny)


def test_resources_are_checked_in_all_and_per_node():
    config = parse_cluster(
        {
            "model": {"path": "meta-llama/Llama-3.1-70B-Instruct", "preset": "llama-3.1-70b"},
            "prefill": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
            "decode": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
        }
    )
    slots = worker_slots(config)
    assert [s.bundles for s in slots] == [({"GPU": 1.0},) * 4] * 2
    check_resources(slots, [{"GPU": 8}])
    check_resources(slots, [{"GPU": 4}, {"GPU": 4}])
    with pytest.raises(ConfigError, match="needs 8 GPU in all but has 6"):
        check_resources(slots, [{"GPU": 4}, {"GPU": 2}])
    with pytest.raises(ConfigError, match="needs 4 GPU on one node.*the largest has 3"):
        check_resources(slots, [{"GPU": 3}, {"GPU": 3}, {"GPU": 2}])


def test_scale_up_names_new_workers_after_the_existing_ones():
    config = parse_cluster({})
    slots = worker_slots(config, {"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 1})
    assert [s.name for s in slots] == ["prefill-2", "decode-1", "decode-2"]


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_cluster_files_are_valid(path):
    config = load_cluster_file(path)
    check_layout(config, model_shape(config))


SEVENTY_B_FILES = {"llama-3.1-70b-tp4-1p1d.yaml": 8, "llama-3.1-70b-fp8-4p1d.yaml": 12}


def test_the_70b_files_gpu_counts():
    """TP=4 prefill and decode on 8 GPUs; four TP=2 FP8 prefill workers (67.7 GiB of FP8
    weights leave too little of one 80 GB card) and a TP=4 decode worker on 12."""
    for name, gpus in SEVENTY_B_FILES.items():
        config = load_cluster_file(DEPLOY / name)
        assert sum(s.tensor_parallel_size for s in worker_slots(config)) == gpus, name


@dataclass
class UpDone:
    returncode: int
    stderr: str


@pytest.fixture
def up(tmp_path, monkeypatch, capsys):
    """`up(cluster_file, *arguments)`: `pdserve up`'s exit code and what it said, run here (as
    `pdserve` runs it, from its command line; in this process: each run is ~3 s less)."""
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-test")  # GPU files: routers beyond loopback

    def run(cluster_file: Path, *extra: str) -> UpDone:
        capsys.readouterr()
        code = cli.main(["up", "-f", str(cluster_file), *extra])
        return UpDone(code, capsys.readouterr().err)

    return run


@pytest.fixture
def run_up(tmp_path, up):
    """`run_up(document, *arguments)`: `up` on a cluster file holding `document`."""

    def run(document, *extra: str) -> UpDone:
        path = tmp_path / "cluster.yaml"
        path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
        return up(path, *extra)

    return run


@pytest.mark.parametrize(
    "document, message",
    [
        ("prefill: [unclosed", "not valid YAML"),
        ({"decode": {"replicas": "2"}}, "decode.replicas: must be an integer"),
        (
            {"decode": {"tensor_parallel_size": 2}, "prefill": {"tensor_parallel_size": 2}},
            "2 does not divide the model's 9 attention heads",
        ),
        (
            {"prefill": {"gpu_type": "H100-SXM"}, "decode": {"gpu_type": "H100-SXM"}},
            "the cluster needs 2 GPU in all but has 0",
        ),
    ],
)
def test_up_refuses_a_bad_cluster_before_starting_anything(tmp_path, run_up, document, message):
    done = run_up(document)
    assert done.returncode == 2
    assert message in done.stderr
    assert "refused" in done.stderr or "not valid YAML" in done.stderr
    assert not (tmp_path / "state").exists(), "up started something"


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, run_up):
    done = run_up({"prefill": {"replicas": 2}, "decode": {"replicas": 1}}, "--dry-run")
    assert done.returncode == 0, done.stderr
    for worker in ("prefill-0", "prefill-1", "decode-0"):
        assert worker in done.stderr
    assert "dry run: nothing started" in done.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize(
    "name, memory",
    [
        (
            "llama-3.1-70b-tp4-1p1d.yaml",
            [
                "prefill TP 4 on H100-SXM: weights 32.85 + KV 16.00 + activations 7.45 + KV "
                "buffers 0.25 = 56.55 GiB per GPU of 74.51 GiB (80 GB)",
                "decode TP 4 on H100-SXM: weights 32.85 + KV 30.00 + activations 7.45 + KV "
                "buffers 1.00 = 71.30 GiB per GPU of 74.51 GiB (80 GB)",
            ],
        ),
        (
            "llama-3.1-70b-fp8-4p1d.yaml",
            [
                "prefill TP 2 on H100-SXM: weights 33.83 + KV 16.00 + activations 7.45 + KV "
                "buffers 0.25 = 57.53 GiB per GPU of 74.51 GiB (80 GB)",
                "decode TP 4 on H100-SXM: weights 16.92 + KV 40.00 + activations 7.45 + KV "
                "buffers 1.00 = 65.37 GiB per GPU of 74.51 GiB (80 GB)",
            ],
        ),
    ],
)
def test_a_dry_run_plans_a_70b_file_against_the_gpus_it_asks_for(tmp_path, up, name, memory):
    done = up(DEPLOY / name, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "decode-0     decode     4  {GPU: 1} {GPU: 1} {GPU: 1} {GPU: 1}" in done.stderr
    for line in memory:  # each pool's GPU memory, per GPU, against the card's
        assert f"memory: {line}\n" in done.stderr
    assert "checks passed: head layout, GPU memory, 1 node(s)" in done.stderr
    assert f"GPU {SEVENTY_B_FILES[name]}\n" in done.stderr
    assert "dry run: nothing started" in done.stderr
    assert not (tmp_path / "state").exists()


def test_a_dry_run_plans_the_deepseek_wide_ep_file_a_worker_per_node(tmp_path, up):
    """DeepSeek-R1 in FP8 as data-parallel groups (prefill DP/EP 16, decode DP/EP 32) on six
    8-GPU nodes: each group a worker per node, each GPU its experts' share (tests/unit/
    test_wide_ep.py checks the parts)."""
    done = up(DEPLOY / "deepseek-r1-wide-ep.yaml", "--dry-run", "--assume-nodes", "6")
    assert done.returncode == 0, done.stderr
    assert "prefill-1    prefill    1  {GPU: 8}  8 DP ranks, node 1 of prefill-0's group" in (
        done.stderr
    )
    assert "decode-3     decode     1  {GPU: 8}  8 DP ranks, node 3 of decode-0's group" in (
        done.stderr
    )
    assert "memory: decode TP 1 x DP 32, EP 32 on H100-SXM: weights 36.70 + KV 28.00" in (
        done.stderr
    )
    assert "checks passed: head layout, GPU memory, 6 node(s) with CPU" in done.stderr
    assert "GPU 48\n" in done.stderr and not (tmp_path / "state").exists()


def test_up_refuses_the_old_70b_fp8_layout_naming_the_numbers(tmp_path, run_up):
    """One TP=1 prefill worker holding all 67.7 GiB of FP8 weights, as the 70B FP8 file had it:
    refused before anything starts, with each term per GPU and the card's memory."""
    done = run_up(
        {
            "model": {"path": "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", "dtype": "bfloat16"},
            "engine": {"kv_cache_gib": 8},
            "prefill": {"replicas": 4, "tensor_parallel_size": 1, "gpu_type": "H100-SXM"},
            "decode": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
        },
        "--dry-run",
    )
    assert done.returncode == 2
    assert (
        "refused: does not fit in GPU memory: prefill TP 1 on H100-SXM: weights 67.67 + KV 8.00 "
        "+ activations 7.45 + KV buffers 0.25 = 83.37 GiB per GPU of 74.51 GiB (80 GB), 8.86 "
        "GiB over (lower <pool>.kv_cache_gib"
    ) in done.stderr
    assert "decode TP 4" not in done.stderr  # the decode pool fits: only the prefill is named
    assert not (tmp_path / "state").exists()


def test_a_dry_run_on_assumed_nodes_checks_that_each_tp_group_fits_one(tmp_path, run_up):
    done = run_up(
        {
            "model": {**H100_70B, "preset": "llama-3.1-70b"},
            "prefill": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
            "decode": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
        },
        "--dry-run",
        "--assume-gpus",
        "8",
        "--assume-nodes",
        "4",
    )
    assert done.returncode == 2
    assert "needs 4 GPU on one node" in done.stderr


def test_a_local_folder_is_sized_from_its_config_and_its_quantization_config(tmp_path):
    """No hub: the shape, parameter count and FP8 layers come from the folder's config.json."""
    config_json = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}},
        },
    }
    folder = tmp_path / "llama-70b-fp8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json))
    config = parse_cluster(
        {
            "model": {"path": str(folder), "dtype": "bfloat16"},
            "prefill": {"replicas": 0},
            "decode": {"tensor_parallel_size": 2, "gpu_type": "H100-SXM"},
        }
    )
    model = model_shape(config)
    assert (model.num_params, model.quantization) == (70_553_706_496, "fp8")
    (decode,) = memory_use(config, model)
    assert round(decode.weights / GIB, 2) == 33.83  # half of 67.67 GiB
