"""Cluster files: schema validation, head-layout and resource checks, and `pdserve up`
refusing a bad file before anything starts. No engine, no Ray."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pdserve.cluster.placement import check_layout, check_resources, model_shape, worker_slots
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


def test_the_70b_files_use_eight_gpus():
    for name in ("llama-3.1-70b-tp4-1p1d.yaml", "llama-3.1-70b-fp8-4p1d.yaml"):
        config = load_cluster_file(DEPLOY / name)
        gpus = sum(s.tensor_parallel_size for s in worker_slots(config))
        assert gpus == 8, name


def run_up(tmp_path, document, *extra) -> subprocess.CompletedProcess:
    path = tmp_path / "cluster.yaml"
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    env = {**os.environ, "PDSERVE_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", "-f", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


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
def test_up_refuses_a_bad_cluster_before_starting_anything(tmp_path, document, message):
    done = run_up(tmp_path, document)
    assert done.returncode == 2
    assert message in done.stderr
    assert "refused" in done.stderr or "not valid YAML" in done.stderr
    assert not (tmp_path / "state").exists(), "up started something"


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    done = run_up(tmp_path, {"prefill": {"replicas": 2}, "decode": {"replicas": 1}}, "--dry-run")
    assert done.returncode == 0, done.stderr
    for worker in ("prefill-0", "prefill-1", "decode-0"):
        assert worker in done.stderr
    assert "dry run: nothing started" in done.stderr
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("name", ["llama-3.1-70b-tp4-1p1d.yaml", "llama-3.1-70b-fp8-4p1d.yaml"])
def test_a_dry_run_plans_a_70b_file_against_the_gpus_it_asks_for(tmp_path, name):
    env = {**os.environ, "PDSERVE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.cli", "up", "-f", str(DEPLOY / name), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "decode-0     decode     4  {GPU: 1} {GPU: 1} {GPU: 1} {GPU: 1}" in done.stderr
    assert "GPU 8" in done.stderr and "dry run: nothing started" in done.stderr
    assert not (tmp_path / "state").exists()


def test_a_dry_run_on_assumed_nodes_checks_that_each_tp_group_fits_one(tmp_path):
    done = run_up(
        tmp_path,
        {
            "model": {"path": "meta-llama/Llama-3.1-70B-Instruct", "preset": "llama-3.1-70b"},
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
