"""`pdserve plan --gpus`: the candidate space, the search's choice, its table and cluster file."""

import argparse
from dataclasses import replace

import pytest
import yaml

from pdserve.bench.metrics import Slo
from pdserve.bench.workload import Length
from pdserve.cluster.placement import (
    check_layout,
    check_memory,
    check_resources,
    memory_use,
    model_shape,
    worker_slots,
)
from pdserve.core.gpu_spec import GB, GPU_PRESETS
from pdserve.planner.command import add_parser
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.planner.search import (
    Candidate,
    RooflineHardware,
    Scenario,
    candidates,
    head_splits,
    search,
)
from pdserve.planner.sim_workload import WorkloadSpec
from pdserve.settings.cluster_file import load_cluster_file
from tests.unit.calibrations import CALIBRATION

LLAMA_8B = MODEL_PRESETS["llama-3.1-8b"]
H100 = GPU_PRESETS["H100-SXM"]


def test_candidates_fit_the_gpus_and_split_heads_evenly():
    found = candidates(head_splits(LLAMA_8B, 8), 8)
    split = [c for c in found if not c.colocated]
    assert Candidate(7, 1, 1, 1) in split and Candidate(1, 4, 1, 4) in split
    assert all(c.gpus <= 8 and c.prefill_replicas >= 1 and c.decode_replicas >= 1 for c in split)
    assert {c.prefill_tp for c in split} == {1, 2, 4}  # TP 8 leaves no GPU for the other pool
    assert head_splits(MODEL_PRESETS["smollm2-135m"], 8) == [1, 3]  # 9 attention, 3 KV heads


def test_candidates_include_colocated_replicas_of_every_tp():
    colocated = [c for c in candidates([1, 2, 4, 8], 8) if c.colocated]
    # data parallel 1..8 at TP 1, 1..4 at TP 2, 1..2 at TP 4, 1 at TP 8
    assert len(colocated) == 8 + 4 + 2 + 1
    assert Candidate(0, 8, 1, 8) in colocated and Candidate(0, 2, 4, 2) in colocated
    assert Candidate(0, 2, 4, 2).label == "colocated 4×TP2" and Candidate(0, 2, 4, 2).gpus == 8


def test_a_configuration_whose_pool_does_not_fit_its_gpus_is_not_simulated():
    """70B bfloat16 on 80 GB (74.51 GiB) cards: 131.4 GiB of weights fit none at TP 1; at TP 2,
    65.71 GiB per GPU beside the 7.45 GiB reserve leave 1.1 GiB for a prefill rank (its 0.25 GiB
    send budget counted) but 0.35 GiB for a decode rank (its 1 GiB inbox): below the 1 GiB of
    KV a pool needs. At TP 4 the decode ranks have 33 whole GiB each."""
    llama_70b = MODEL_PRESETS["llama-3.1-70b"]
    hardware = RooflineHardware(llama_70b, H100, 25 * GB, 1e-3)
    assert hardware.cluster(Candidate(1, 1, 1, 4)) is None
    assert hardware.cluster(Candidate(1, 2, 1, 2)) is None
    cluster = hardware.cluster(Candidate(1, 2, 1, 4))
    per_token = 2 * 80 * 8 * 128 * 2  # K and V, 80 layers, 8 KV heads of 128, bfloat16
    assert cluster.kv_capacity_tokens == 33 * 2**30 * 4 // per_token


def _searched(workload: WorkloadSpec, slo: Slo) -> list:
    hardware = RooflineHardware(LLAMA_8B, H100, kv_bandwidth_bytes_per_s=25 * GB, kv_latency_s=1e-3)
    evaluations = search(hardware, Scenario(workload, slo, num_requests=40), gpus=4)
    assert evaluations == sorted(evaluations, key=lambda e: -e.goodput_per_gpu)
    return evaluations


def _best_split(evaluations) -> Candidate:
    return next(e.candidate for e in evaluations if not e.candidate.colocated)


def test_search_gives_long_prompts_more_prefill_and_long_outputs_more_decode():
    prefill_heavy = _searched(
        WorkloadSpec(Length.parse("4096"), Length.parse("16")), Slo(ttft=1.0, tpot=0.05)
    )
    prefill_bound = _best_split(prefill_heavy)
    assert (
        prefill_bound.prefill_replicas * prefill_bound.prefill_tp
        > prefill_bound.decode_replicas * prefill_bound.decode_tp
    )
    # A TPOT loose enough to absorb a 4096-token prefill in the decode batch: colocated wins,
    # no GPU waits on the other pool.
    assert prefill_heavy[0].candidate.colocated
    assert prefill_heavy[0].goodput_per_gpu > 1.05 * next(
        e.goodput_per_gpu for e in prefill_heavy if not e.candidate.colocated
    )
    decode_heavy = _searched(
        WorkloadSpec(Length.parse("32"), Length.parse("64")), Slo(ttft=1.0, tpot=0.007)
    )
    decode_bound = _best_split(decode_heavy)
    assert (
        decode_bound.decode_replicas * decode_bound.decode_tp
        > decode_bound.prefill_replicas * decode_bound.prefill_tp
    )
    # A tight TPOT: prefills stalling the decode batch cost colocated replicas their goodput.
    assert not decode_heavy[0].candidate.colocated


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
        "ttft=300ms,tpot=15ms",
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
    assert len(rows) == 5
    colocated = [line for line in out.splitlines() if "colocated" in line]
    assert len(colocated) == 3 + 1  # 1, 2, 3 replicas at TP 1; 1 at TP 2
    assert len(rows) + len(colocated) == len(candidates(head_splits(LLAMA_8B, 3), 3))
    assert rows[0].startswith("* ") and sum(row.startswith("*") for row in rows) == 1
    assert "goodput" in out.splitlines()[0] and "p90 TTFT ms" in out
    # At 20 req/s, two GPUs meet the SLO: the best goodput per GPU uses no third one. One
    # colocated GPU does not: its prefills of 1024 tokens stall the decode batch past the TPOT,
    # so it ranks below every configuration that meets the SLO, whatever its goodput per GPU.
    assert "recommended: 1P×TP1 + 1D×TP1" in out
    (one_gpu,) = [line for line in colocated if "colocated 1×TP1" in line]
    assert not one_gpu.endswith("100%") and out.splitlines().index(one_gpu) > 3
    cluster = yaml.safe_load(path.read_text())
    # Each pool's KV cache: the whole GiB per GPU that 80 GB (74.51 GiB) leaves beside 14.96 GiB
    # of weights, 7.45 GiB of activations and pdserve's buffers (prefill 0.25, decode 1 GiB).
    assert cluster["prefill"] == {
        "replicas": 1,
        "tensor_parallel_size": 1,
        "gpu_type": "H100-SXM",
        "kv_cache_gib": 51,
    }
    assert cluster["decode"]["kv_cache_gib"] == 51
    assert cluster["decode"]["replicas"] == 1 and cluster["model"]["preset"] == "llama-3.1-8b"
    assert "memory: decode TP 1 on H100-SXM: weights 14.96 + KV 51.00" in out
    # `pdserve up` accepts the file: schema, head layout, GPU memory, and its 2 GPUs on one
    # 8-GPU node.
    config = load_cluster_file(path)
    check_layout(config, model_shape(config))
    check_memory(memory_use(config, model_shape(config)))
    check_resources(worker_slots(config), [{"GPU": 8}])


def test_plan_recommends_colocated_where_one_gpu_meets_the_slo(tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    argv = ["--model", "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "3", "--rate", "20"]
    argv += ["--slo", "ttft=300ms,tpot=30ms", "--input-len", "1024", "--output-len", "64"]
    assert _run_plan([*argv, "--num-requests", "40", "--write-cluster", str(path)]) == 0
    assert "recommended: colocated 1×TP1, 20.000 req/s per GPU" in capsys.readouterr().out
    cluster = load_cluster_file(path)
    assert cluster.prefill.replicas == 0 and cluster.decode.replicas == 1
    check_layout(cluster, model_shape(cluster))
    check_resources(worker_slots(cluster), [{"GPU": 8}])


def test_plan_with_a_calibration_searches_measured_workers_and_their_contention(tmp_path, capsys):
    argv = ["--model", "smollm2-135m", "--gpus", "2", "--slo", "ttft=2s,tpot=150ms"]
    argv += ["--workload", "mixed", "--output-len", "64", "--num-requests", "40"]
    argv += ["--kv-bandwidth-gbs", "0.5", "--kv-latency-ms", "5"]
    goodputs = {}
    for contention in (0.0, 1.0):
        path = tmp_path / f"calibration-{contention}.json"
        replace(CALIBRATION, prefill_contention=contention, decode_contention=contention).save(path)
        assert _run_plan([*argv, "--calibration", str(path)]) == 0
        out = capsys.readouterr().out.splitlines()
        rows = [line for line in out if "×TP" in line and not line.startswith("recommended")]
        labels = {line[2:24].strip() for line in rows}
        # A measured worker is TP 1; two of them share a host.
        assert labels == {"colocated 1×TP1", "colocated 2×TP1", "1P×TP1 + 1D×TP1"}
        split = next(line for line in rows if line[2:24].strip() == "1P×TP1 + 1D×TP1")
        goodputs[contention] = float(split[24:].split()[2])
    # Both workers of 1P1D on one host: contention lowers the rate it can sustain.
    assert goodputs[1.0] < 0.9 * goodputs[0.0]


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
    assert "no configuration of 2 GPU(s) meets the SLO" in capsys.readouterr().err
