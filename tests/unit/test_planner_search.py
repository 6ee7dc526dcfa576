"""`pdserve plan --gpus`: the candidate space, the search's choice, its table and cluster file."""

import argparse

import pytest
import yaml

from bench.metrics import Slo
from bench.workload import Length
from cluster.placement import check_layout, check_resources, model_shape, worker_slots
from planner.command import add_parser
from planner.gpu_spec import GB, GPU_PRESETS
from planner.model_spec import MODEL_PRESETS
from planner.search import Candidate, RooflineHardware, Scenario, candidates, search
from planner.sim_workload import WorkloadSpec
from settings.cluster_file import load_cluster_file

LLAMA_8B = MODEL_PRESETS["llama-3.1-8b"]
H100 = GPU_PRESETS["H100-SXM"]


def test_candidates_fit_the_gpus_and_split_heads_evenly():
    found = candidates(LLAMA_8B, 8)
    assert Candidate(7, 1, 1, 1) in found and Candidate(1, 4, 1, 4) in found
    assert all(c.gpus <= 8 and c.prefill_replicas >= 1 and c.decode_replicas >= 1 for c in found)
    assert {c.prefill_tp for c in found} == {1, 2, 4}  # TP 8 leaves no GPU for the other pool
    smollm2 = {c.decode_tp for c in candidates(MODEL_PRESETS["smollm2-135m"], 8)}
    assert smollm2 == {1, 3}  # 9 attention and 3 KV heads: TP 1 or 3


def _best(workload: WorkloadSpec, slo: Slo) -> Candidate:
    hardware = RooflineHardware(LLAMA_8B, H100, kv_bandwidth_bytes_per_s=25 * GB, kv_latency_s=1e-3)
    evaluations = search(hardware, Scenario(workload, slo, num_requests=60), gpus=4)
    assert evaluations == sorted(evaluations, key=lambda e: -e.goodput_per_gpu)
    return evaluations[0].candidate


def test_search_gives_long_prompts_more_prefill_and_long_outputs_more_decode():
    prefill_bound = _best(
        WorkloadSpec(Length.parse("4096"), Length.parse("16")), Slo(ttft=1.0, tpot=0.05)
    )
    assert (
        prefill_bound.prefill_replicas * prefill_bound.prefill_tp
        > prefill_bound.decode_replicas * prefill_bound.decode_tp
    )
    decode_bound = _best(
        WorkloadSpec(Length.parse("32"), Length.parse("256")), Slo(ttft=1.0, tpot=0.007)
    )
    assert (
        decode_bound.decode_replicas * decode_bound.decode_tp
        > decode_bound.prefill_replicas * decode_bound.prefill_tp
    )


def _run_plan(argv):
    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.run(args)


def test_plan_prints_the_searched_table_and_writes_the_recommended_cluster(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    argv = [
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "H100-SXM",
        "--gpus",
        "3",
        "--slo",
        "ttft=300ms,tpot=30ms",
        "--input-len",
        "1024",
        "--output-len",
        "64",
        "--num-requests",
        "40",
        "--rate",
        "20",
        "--write-cluster",
        str(path),
    ]
    assert _run_plan(argv) == 0
    out = capsys.readouterr().out
    rows = [
        line
        for line in out.splitlines()
        if "P×TP" in line and "D×TP" in line and not line.startswith("recommended")
    ]
    # At TP 1: 1+1, 1+2, 2+1; and one pool at TP 2 beside the other at TP 1: 1×TP2 + 1, 1 + 1×TP2.
    assert len(rows) == len(candidates(LLAMA_8B, 3)) == 5
    assert rows[0].startswith("* ") and sum(row.startswith("*") for row in rows) == 1
    assert "goodput" in out.splitlines()[0] and "p90 TTFT ms" in out
    # At 20 req/s, two GPUs meet the SLO: the best goodput per GPU uses no third one.
    assert "recommended: 1P×TP1 + 1D×TP1" in out
    cluster = yaml.safe_load(path.read_text())
    assert cluster["prefill"] == {"replicas": 1, "tensor_parallel_size": 1, "gpu_type": "H100-SXM"}
    assert cluster["decode"]["replicas"] == 1 and cluster["model"]["preset"] == "llama-3.1-8b"
    # `pdserve up` accepts the file: schema, head layout, and its 2 GPUs on one 8-GPU node.
    config = load_cluster_file(path)
    check_layout(config, model_shape(config))
    check_resources(worker_slots(config), [{"GPU": 8}])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "4"], "needs --slo"),
        (["--gpus", "4", "--slo", "ttft=fast"], "bad SLO item"),
        (["--gpus", "4", "--slo", "ttft=1s", "--input-len", "0"], "bad length"),
    ],
)
def test_plan_search_bad_input_exits_2(argv, message, capsys):
    assert _run_plan(["--model", "llama-3.1-8b", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_reports_an_unreachable_slo(capsys):
    argv = ["--model", "llama-3.1-8b", "--gpus", "2", "--slo", "ttft=1ms", "--num-requests", "20"]
    assert _run_plan(argv) == 1
    assert "no split of 2 GPU(s) meets the SLO" in capsys.readouterr().err
