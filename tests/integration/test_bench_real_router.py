"""`pdserve bench` against the real router: every request succeeds and is measured."""

import json
import subprocess
import sys


def test_bench_measures_the_real_router(server, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "bench",
            "--url",
            server.url,
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--ignore-eos",
            "--slo",
            "ttft=60s,tpot=10s",
            "--output-json",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert (summary["completed"], summary["failed"]) == (4, 0)
    assert summary["total_output_tokens"] == 4 * 8
    assert summary["good_requests"] == 4
    for request in report["requests"]:
        assert request["output_tokens"] == 8
        assert 0 < request["ttft"] < request["e2e"]
