"""scripts/gpu_check.py on CPU, as the lent GPU machine would run it: torch, grpcio and protobuf
only (pydantic, numpy and vLLM made unimportable in its process, as a bare GPU image has none),
every check through pdserve's real sender, transports, receiver and loader: a whole script's
run (no engine, but ~20 s for its --quick subset here, the whole run ~40 s), so it is in this
tier, not the unit tier."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
# What a CPU run may skip: what only CUDA shows.
ALLOWED_SKIPS = ("CUDA only",)


def test_the_quick_check_passes_on_cpu_without_pydantic_numpy_or_vllm(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nfor name in ('pydantic', 'numpy', 'vllm'):\n    sys.modules[name] = None\n"
    )
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(report)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]  # the versions it found come first
    assert first.startswith("versions: python ") and "pydantic absent" in first, first
    checks = json.loads(report.read_text())["checks"]
    failed = [c for c in checks if c["status"] == "FAIL"]
    assert failed == []
    skipped = [c for c in checks if c["status"] == "SKIP"]
    assert all(c["detail"].startswith(ALLOWED_SKIPS) for c in skipped), skipped
    passed = {c["name"] for c in checks if c["status"] == "PASS"}
    for must in (
        "layout LBHNC fp8 (uint8)",
        "layout BHLNC bfloat16",
        "layout old kv,block,token,head,dim float16",
        "transport grpc",
        "transport shm",
        "transport nccl",  # gloo on CPU
        "chunked prefill, mid-block boundary",
        "prefix-cache skip",
        "tp 8 KV heads, prefill TP 4 -> decode TP 1",
        "tp 2 KV heads, prefill TP 1 -> decode TP 4",
        "group whose peer never joins",
        "bandwidth",
    ):
        assert must in passed, (must, done.stdout)


def test_the_whole_run_covers_every_layout_dtype_and_tp_pair_and_the_gpu_tests():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    names = [name for name, _ in gpu_check.checks(torch.device("cpu"), False, 1, 1)]
    layouts = [n for n in names if n.startswith("layout ")]
    assert len(layouts) == 10 * 3 == len(set(layouts))  # vLLM 0.32's six, four older
    assert sum(n.startswith("tp ") for n in names) == len(gpu_check.TP_PAIRS) == 10
    assert len(names) == len(set(names))
    for test in ("T1 ", "T2 ", "T4 "):  # issue 46's GPU tests
        assert any(name.startswith(test) for name in names), test
    assert names[-1].startswith("T1 ")  # started first, collected last


def test_the_gpu_tests_skip_on_cpu_with_cuda_only_and_t1s_child_compiles():
    """T1, T2, T4 need CUDA: on CPU each says so; T1's child program (run only on a GPU) at
    least compiles here."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    cpu = torch.device("cpu")
    for name, run in gpu_check.checks(cpu, False, 1, 1):
        if name.startswith(("T1 ", "T2 ", "T4 ")):
            result = gpu_check.run_check(name, run, cpu)
            assert result["status"] == "SKIP" and result["detail"].startswith(ALLOWED_SKIPS)
    compile(gpu_check.script("gpu_t1_pg0_kill").CHILD, "gpu_t1_child", "exec")
