"""scripts/compare_outside.py's figures: a run made of vLLM's own result file and what the script
measured beside it, and the summary's medians and per-round ratios to vllm's."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "compare_outside", ROOT / "scripts/compare_outside.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_outside"] = module
    spec.loader.exec_module(module)
    return module


def vllm_result(goodput: float, tpot_ms: float) -> dict:
    """The fields of `vllm bench serve --save-result`'s JSON the script reads."""
    return {
        "completed": 80,
        "failed": 0,
        "request_goodput": goodput,
        "median_ttft_ms": 400.0,
        "median_tpot_ms": tpot_ms,
        "median_itl_ms": 80.0,
    }


def test_a_run_takes_vllms_figures_and_the_cpu_and_switches_per_completed_request():
    script = load_script()
    switches = {"engine core": (160, 4000)}
    result = vllm_result(0.5, 120.0)
    run = script.result_run("vllm", 0, result, 0.1, {"engine core": 8.0}, switches)
    assert run.figures["request_goodput"] == 0.5 and run.figures["median_tpot_ms"] == 120.0
    assert run.cpu_ms_per_request == {"engine core": 100.0}  # 8 s over 80 requests
    assert run.switches_per_request == {"engine core": (2.0, 50.0)}
    assert "engine ITL 100.0 ms" in script.line(run)
    assert "engine core 2/50" in script.line(run)


def test_the_summary_gives_each_round_its_ratio_to_vllms_and_their_median():
    script = load_script()
    runs = [
        script.result_run("vllm", 0, vllm_result(0.5, 100.0), 0.1, {"a": 8.0}, {}),
        script.result_run("colocated", 0, vllm_result(0.4, 110.0), 0.11, {"a": 8.0}, {}),
        script.result_run("vllm", 1, vllm_result(0.25, 100.0), 0.1, {"a": 8.0}, {}),
        script.result_run("colocated", 1, vllm_result(0.25, 130.0), 0.12, {"a": 8.0}, {}),
    ]
    table = script.summary(runs, ["vllm", "colocated"])
    [vllm_row] = [r for r in table.splitlines() if r.startswith("| vllm")]
    [colocated_row] = [r for r in table.splitlines() if r.startswith("| colocated")]
    assert "0.38 [0.25, 0.50] |" in vllm_row and "×" not in vllm_row
    # Goodput 0.8x and 1.0x vLLM's in its two rounds; TPOT 1.1x and 1.3x.
    assert "0.33 [0.25, 0.40], 0.90 [0.80, 1.00]×" in colocated_row
    assert "1.20 [1.10, 1.30]×" in colocated_row
