"""GPU check T2 (scripts/gpu_t2_pool_hold.py), on CPU: it skips cleanly, it imports neither
pydantic nor vLLM (a bare GPU image has neither), and its measurement runs the real copier
through store, load and a refused block, so the GPU run does not fail for a reason a CPU shows."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_t2_pool_hold.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_t2_pool_hold", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_it_skips_on_cpu_without_pydantic_or_vllm(tmp_path):
    """Run as the GPU run runs it, with pydantic and vLLM made unimportable: SKIP, exit 0."""
    report = tmp_path / "t2.json"
    blocked = (
        "import runpy, sys; sys.modules['pydantic'] = None; sys.modules['vllm'] = None; "
        f"sys.argv = [{str(SCRIPT)!r}, '--device', 'cpu', '--json', {str(report)!r}]; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("SKIP"), done.stdout
    assert json.loads(report.read_text())["status"] == "SKIP"


def test_gpu_checks_call_raises_its_skip_on_cpu():
    script = load_script()

    class Skip(Exception):
        pass

    try:
        script.check_pool_hold(torch.device("cpu"), skip=Skip)
    except Skip as why:
        assert "CUDA only" in str(why)
    else:
        raise AssertionError("T2 ran on a CPU")


def test_its_measurement_runs_the_copier_exactly_on_cpu():
    script = load_script()
    for pinned in (True, False):
        holds = script.measure(torch.device("cpu"), pinned, repeats=1, busy_ms=0, page=4096)
        assert holds.exact and holds.refused_as_expected
        assert set(holds.call_ms) == {"store", "load", "poll", "result"}
        assert set(holds.device_us_per_token) == {"store", "load"}
        assert "8 blocks x 32 layers" in script.summary(holds, 0)
