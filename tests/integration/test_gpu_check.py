"""scripts/gpu_check.py on CPU, as the lent GPU machine runs it: torch, grpcio, protobuf and pytest
only (pydantic, numpy and vLLM made unimportable in its processes, as a bare GPU image has none).
The checks themselves are tests/gpu's, which the unit tier runs; this runs the runner, which
imports every check module, over a few of them, and imports what the processes the checks start
import (the KV pool's store, a group's peer, T1's child): whole-script runs, so in this tier."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
BARE_GPU_IMAGE_LACKS = ("pydantic", "numpy", "vllm")
DIGEST_TEST = "test_the_digest_on_the_device_equals_the_cpus_and_catches_a_flipped_bit"


def env_without(tmp_path: Path, modules: tuple[str, ...]) -> dict[str, str]:
    """This environment with `modules` unimportable in every Python process started with it."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n"
    )
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}


def test_the_runner_reports_each_check_and_a_module_that_fails_to_import(tmp_path):
    """Versions first; a line and a JSON row per check, CUDA's own skipped as "CUDA only", T1's
    last; a check module that fails to import (the KV pool's here) is a FAIL of its own, the
    others still run, and the run exits 1."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--device", "cpu", "--json", str(report)),
            *("--", "-k", "digest or nccl_send or pg0"),
        ],
        cwd=tmp_path,
        env=env_without(tmp_path, (*BARE_GPU_IMAGE_LACKS, "kv_transfer.pool.peer")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("versions: python ") and "pydantic absent" in first, first
    found = json.loads(report.read_text())
    assert found["versions"]["numpy"] == "absent" and found["device"] == "cpu"
    checks = {c["name"]: c for c in found["checks"]}
    assert found["counts"] == {"PASS": 1, "FAIL": 1, "SKIP": 4}, checks
    broken = checks["test_kv_pool_on_device.py"]
    assert broken["status"] == "FAIL" and "kv_transfer.pool.peer" in broken["detail"], broken
    digest = checks[f"test_digest_on_device.py::{DIGEST_TEST}[cpu]"]
    assert digest["status"] == "PASS" and "GB/s" in digest["detail"], digest
    skipped = [c for c in checks.values() if c["status"] == "SKIP"]
    assert all(c["detail"].startswith("CUDA only") for c in skipped), skipped
    assert found["checks"][-1]["name"].startswith("test_pg0_survives.py::")  # T1 judged last
    rows = [line for line in done.stdout.splitlines() if f"{DIGEST_TEST}[cpu]" in line]
    assert rows[-1].startswith("PASS") and "GB/s" in rows[-1], rows


def test_what_the_checks_child_processes_import_needs_no_pydantic_numpy_or_vllm(tmp_path):
    """The KV pool's store, a group's peer and T1's child program (compiled here: T1 runs only
    on a GPU)."""
    child = (
        "import importlib.util\n"
        "spec = importlib.util.spec_from_file_location('t1', 'scripts/gpu_t1_pg0_kill.py')\n"
        "t1 = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(t1)\n"
        "compile(t1.CHILD, 'gpu_t1_child', 'exec')\n"
        "import kv_transfer.pool.store, kv_transfer.pool.peer, kv_transfer.nccl_transport\n"
        "import pdserve.worker.gpu_environment\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        cwd=ROOT,
        env=env_without(tmp_path, BARE_GPU_IMAGE_LACKS),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
