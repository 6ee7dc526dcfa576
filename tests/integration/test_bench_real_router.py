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
            "pdserve.cli",
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


def test_vllm_bench_serve_runs_against_the_router_with_no_failed_request(server, smollm2_dir):
    """vLLM's own benchmark, as its users run it (random dataset, streamed completions, the
    nulls and vLLM-only fields it sends), half its requests long enough to disaggregate."""
    done = subprocess.run(
        [
            sys.executable,
            "scripts/vllm_bench_serve.py",
            "--base-url",
            server.url,
            "--model",
            "smollm2",
            "--tokenizer",
            str(smollm2_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            "256",
            "--random-range-ratio",
            "0.5",
            "--random-output-len",
            "8",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout[done.stdout.find("Serving Benchmark Result") - 50 :]
    print(summary)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = dict(line.split(":", 1) for line in summary.splitlines() if line.count(":") == 1)
    assert int(lines["Successful requests"]) == 12
    assert int(lines["Failed requests"]) == 0
