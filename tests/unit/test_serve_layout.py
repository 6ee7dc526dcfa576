"""`pdserve serve --layout auto`: the plan, the options it turns into, and --dry-run starting
nothing (the real command line, in this process: a dry run returns before any worker)."""

import argparse
import json
from pathlib import Path

import pytest

from pdserve.bench.metrics import Slo
from pdserve.cli import main
from pdserve.cluster import serve_layout
from pdserve.cluster.serve_layout import REFERENCE_CALIBRATIONS, PlannedLayout
from pdserve.planner.calibration import Calibration
from pdserve.planner.host_layouts import (
    HOST_WORKLOAD,
    host_hardware,
    rank_host_layouts,
    ranking_table,
)
from pdserve.planner.search import Scenario
from tests.unit.calibrations import MODEST_LONE, TWO_CORES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))  # no host calibration there


@pytest.mark.parametrize(
    "calibration, slo, layout, options",
    [
        (TWO_CORES, "ttft=2s,tpot=150ms", "colocated", "--colocated --workers 1"),
        (MODEST_LONE, "ttft=1s,tpot=100ms", "1P1D", "--prefill 1 --decode 1"),
    ],
)
def test_a_dry_run_prints_the_ranking_and_the_layout_and_starts_nothing(
    no_gpus, tmp_path, capsys, calibration, slo, layout, options
):
    path = tmp_path / "calibration.json"
    calibration.save(path)
    argv = ["serve", "--layout", "auto", "--slo", slo, "--calibration", str(path), "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"planning with {path}" in out
    rows = [line for line in out.splitlines() if line.startswith(("* ", "  "))]
    assert len(rows) == 4 and rows[1].startswith(f"* {layout} ")  # a header, three layouts
    assert f"layout: {layout} (pdserve serve {options})" in out


QUICK = ["--slo", "ttft=2s,tpot=150ms", "--plan-rate", "1", "--dry-run"]  # one run a layout


def test_this_hosts_calibration_file_is_the_default(no_gpus, capsys):
    TWO_CORES.save(serve_layout.calibration_file())
    assert main(["serve", "--layout", "auto", *QUICK]) == 0
    assert f"planning with {serve_layout.calibration_file()}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "dtype, bfloat16_cpu, measured_in",
    [
        (None, True, "bfloat16"),  # --dtype's default, auto
        ("auto", True, "bfloat16"),
        ("auto", False, "float32"),
        ("float32", True, "float32"),
        ("bfloat16", False, "bfloat16"),
        ("float16", True, "float32"),  # none measured in it: the float32 one, named
    ],
)
def test_without_one_the_reference_calibration_of_the_workers_dtype_plans_and_says_so(
    no_gpus, monkeypatch, capsys, dtype, bfloat16_cpu, measured_in
):
    monkeypatch.setattr("pdserve.worker.engine_dtype.cpu_multiplies_bfloat16", lambda: bfloat16_cpu)
    given = [] if dtype is None else ["--dtype", dtype]
    assert main(["serve", "--layout", "auto", *given, *QUICK]) == 0
    out = capsys.readouterr().out
    assert "no calibration of this host" in out and "validate_simulator.py" in out
    assert f"measured in {measured_in} (this host's workers: " in out
    assert f"planning with {REFERENCE_CALIBRATIONS[measured_in]}" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--layout auto needs --slo"),
        (["--slo", "ttft=2s", "--colocated"], "leave out --colocated and --flex"),
        (["--slo", "ttft=2s", "--plan-rate", "0"], "--plan-rate: must be > 0"),
        (["--slo", "ttft=fast"], "bad SLO item"),
        (["--slo", "ttft=1ms", "--plan-rate", "1"], "no layout of this host serves a request"),
    ],
)
def test_bad_plans_are_refused_before_anything_starts(no_gpus, capsys, extra, message):
    assert main(["serve", "--layout", "auto", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_dry_run_without_auto_is_refused(capsys):
    assert main(["serve", "--dry-run"]) == 2
    assert "--dry-run: only with --layout auto" in capsys.readouterr().err


def test_on_gpus_without_a_calibration_it_searches_their_roofline(no_gpus, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    argv = ["serve", "--layout", "auto", "--slo", "ttft=2s,tpot=150ms", "--dry-run"]
    assert main([*argv, "--model", "meta-llama/Llama-3.1-8B"]) == 2
    assert "needs --gpu" in capsys.readouterr().err
    assert main([*argv, "--model", "llama-3.1-8b", "--gpu", "H100-SXM"]) == 0
    out = capsys.readouterr()
    assert "planning 4 x H100-SXM at their roofline" in out.out
    (chosen,) = [line for line in out.out.splitlines() if line.startswith("* ")]
    assert int(chosen.split()[-7]) == 4  # the whole host serves: every GPU used


def test_the_planned_layout_replaces_the_worker_options():
    args = argparse.Namespace(
        colocated=True, flex=2, prefill=1, decode=1, workers=1, tensor_parallel_size=1,
        prefill_tensor_parallel_size=None, prefill_kv_transports="grpc",
    )  # fmt: skip
    PlannedLayout("1P×TP2 + 2D×TP1", False, 1, 2, 2, 1).apply(args)
    assert (args.colocated, args.flex, args.prefill, args.decode) == (False, 0, 1, 2)
    assert (args.prefill_tensor_parallel_size, args.tensor_parallel_size) == (2, 1)
    assert args.prefill_kv_transports == ""
    options = PlannedLayout("x", False, 1, 2, 2, 1).serve_arguments
    assert options == [
        "--prefill", "1", "--decode", "2", "--tensor-parallel-size", "1",
        "--prefill-tensor-parallel-size", "2",
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(REFERENCE_CALIBRATIONS))
def test_each_reference_calibration_is_a_valid_file(dtype):
    path = REFERENCE_CALIBRATIONS[dtype]
    calibration = Calibration.load(path)
    assert calibration.workers_per_host == 2 and calibration.model == "smollm2"
    assert json.loads(path.read_text())["format"] == "pdserve-calibration/2"


def test_bfloat16s_reference_has_cheaper_steps():
    float32, bfloat16 = (
        Calibration.load(REFERENCE_CALIBRATIONS[d]) for d in ("float32", "bfloat16")
    )
    assert bfloat16.alone_decode_base_s < float32.alone_decode_base_s
    assert bfloat16.alone_prefill_per_token_s < float32.alone_prefill_per_token_s


@pytest.mark.parametrize("dtype", sorted(REFERENCE_CALIBRATIONS))
def test_with_the_reference_calibration_it_starts_the_measured_winner_for_each_slo(dtype):
    """scripts/simulator_validation_DTYPE.json is one measurement of the three layouts on the
    host the reference calibration of that dtype was measured on, at three rates under both
    SLOs: the layout the plan starts for each SLO is the one whose best measured goodput was
    highest."""
    cells = json.loads((ROOT / "scripts" / f"simulator_validation_{dtype}.json").read_text())
    hardware = host_hardware(Calibration.load(REFERENCE_CALIBRATIONS[dtype]))
    for slo in sorted({cell["slo"] for cell in cells}):
        peaks: dict[str, float] = {}
        for cell in (c for c in cells if c["slo"] == slo):
            peaks[cell["layout"]] = max(peaks.get(cell["layout"], 0.0), cell["measured"])
        measured_best = max(peaks, key=peaks.get)
        ranked = rank_host_layouts(hardware, Scenario(HOST_WORKLOAD, Slo.parse(slo)))
        assert len(peaks) == len(ranked) == 3
        assert ranked[0].layout.name == measured_best, (slo, peaks, ranking_table(ranked))
