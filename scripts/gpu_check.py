"""Run the GPU checks (tests/gpu, pytest marker `gpu`) on one device in one call, with a report.

    python3 scripts/gpu_check.py --json $OUT/gpu_check.json   # the lent GPU machine: ~3-4 min
    python scripts/gpu_check.py --device cpu                  # on the CPU: ~25 s here
    python3 scripts/gpu_check.py -- -k "not pg0" -x           # pytest's own arguments after --

It prints the versions it found first (a failure on an unknown image reads against them), runs
pytest over tests/gpu on `--device` (CUDA when present, else the CPU), then one line per check
(PASS, FAIL or SKIP, seconds, what it measured or why it failed or skipped) and writes them to
`--json`. A failure never stops the other checks; a check module that fails to import is a FAIL
row of its own (named by its file). Exits 1 if anything failed, else pytest's exit code.

Dependencies: torch, grpcio, protobuf and pytest (a bare GPU image has them); no pydantic, numpy
or vLLM, no network (everything on 127.0.0.1): the data plane's classes import without them, and
the conftest files above tests/gpu, which import more, are not loaded.
"""

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "gpu"


class Report:
    """A pytest plugin: each check's row (setup, call and teardown taken together), and a row
    for each check module that failed to import."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.rows[report.nodeid] = row(report.nodeid, "FAIL", failure(report))

    def pytest_runtest_logreport(self, report) -> None:
        found = self.rows.setdefault(report.nodeid, row(report.nodeid, "PASS", ""))
        found["seconds"] = round(found["seconds"] + report.duration, 3)
        if report.skipped:
            found["status"], found["detail"] = "SKIP", report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            found["status"], found["detail"] = "FAIL", failure(report)
        elif report.when == "call":
            found["detail"] = dict(report.user_properties).get("detail", "")


def row(nodeid: str, status: str, detail: str) -> dict:
    name = nodeid.removeprefix("tests/gpu/")
    return {"name": name, "status": status, "seconds": 0.0, "detail": detail}


def failure(report) -> str:
    """What failed, and where (the check's own line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return str(report.longrepr).strip().splitlines()[-1]
    return f"{crash.message.splitlines()[0]} (at {Path(crash.path).name}:{crash.lineno})"


def versions() -> dict[str, str]:
    """What this machine has of what the data plane needs (and of what it must do without)."""
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    found["cuda"] = str(torch.version.cuda)
    found["nccl"] = (
        ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    )
    for module in ("pytest", "grpc", "google.protobuf", "pydantic", "numpy", "vllm"):
        try:
            found[module] = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            found[module] = "absent"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--json", type=Path, help="write every check's result here")
    parser.add_argument("pytest_args", nargs="*", help="pytest's own arguments, after --")
    args = parser.parse_args()
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}", flush=True)
    if found["pytest"] == "absent":
        print("pytest is absent: the checks are pytest tests (tests/gpu)", flush=True)
        return 2
    import pytest  # present: checked just above, after the versions were printed

    # The checks' child processes (the KV pool's store) import this tree, wherever this runs from.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getenv("PYTHONPATH"), str(ROOT)]))
    report = Report()
    started = time.perf_counter()
    code = pytest.main(
        [
            str(CHECKS),
            "-m",
            "gpu",
            f"--check-device={device.type}",
            f"--rootdir={ROOT}",
            f"--confcutdir={CHECKS}",  # tests/conftest.py imports what a bare image lacks
            "--continue-on-collection-errors",  # a module that fails to import stops no other
            "-p",
            "no:cacheprovider",
            "--tb=short",
            *args.pytest_args,
        ],
        plugins=[report],
    )
    total = time.perf_counter() - started
    results = list(report.rows.values())
    for result in results:
        print(
            f"{result['status']:<4} {result['seconds']:7.2f} s  {result['name']}  "
            f"{result['detail']}"
        )
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
        f"in {total:.1f} s (pytest exit {int(code)})"
    )
    if args.json:
        summary = {
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "versions": found,
            "seconds": round(total, 1),
            "pytest_exit": int(code),
            "counts": counts,
            "checks": results,
        }
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if counts["FAIL"] else int(code)


if __name__ == "__main__":
    sys.exit(main())
