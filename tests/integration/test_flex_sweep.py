"""`pdserve sweep --flex` over three ratios on the tiny model: one cluster of flex workers for
the whole sweep (every worker starts its engine once), the ratios set by role changes, and the
same table, JSON and plot as a sweep that restarts a cluster per ratio."""

import json
import subprocess
import sys

from pdserve.worker.processes import free_port

RATIOS = "1:1,2:1,1:2"


def test_a_flex_sweep_starts_each_engine_once(tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "sweep",
            "--flex",
            "--ratios",
            RATIOS,
            "--rates",
            "4",
            "--num-requests",
            "3",
            "--warmup",
            "1",
            "--input-len",
            "40",
            "--output-len",
            "4",
            "--slo",
            "ttft=30s,tpot=5s",
            "--no-progress",
            "--port",
            str(free_port()),
            "--serve-args",
            "--model tiny --kv-cache-gib 0.25 --disaggregate-min-tokens 0",
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout, done.stderr[-2000:])
    assert "starting 3 flex worker(s) for every ratio" in done.stderr  # progress goes to stderr
    assert done.stderr.count("roles set in") == 3
    assert all(
        f"* {ratio} " in done.stdout or f"  {ratio} " in done.stdout for ratio in RATIOS.split(",")
    )
    points = json.loads((out / "sweep.json").read_text())["points"]
    assert sorted({p["ratio"] for p in points}) == sorted(RATIOS.split(","))
    assert all(p["summary"]["failed"] == 0 for p in points)
    assert (out / "goodput_per_worker.png").stat().st_size > 0
    worker_logs = sorted((out / "logs-flex3").glob("flex-*.log"))
    assert len(worker_logs) == 3
    for log in worker_logs:
        assert log.read_text().count("starting the engine") == 1, log
