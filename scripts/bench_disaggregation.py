"""TTFT with and without disaggregation, side by side, on one running cluster.

For each prompt length, requests alternate between the local path (the decode worker prefills
the prompt itself) and the disaggregated path (the prefill worker computes it and pushes the KV
layer by layer), so both see the same machine noise. Every prompt is fresh random token ids:
no prefix cache helps either side. Timings come from the router's breakdown (x-pdserve-timing):
TTFT at the router, the prefill worker's prefill time, the KV transfer (first to last slice
received) and its exposed part (what the decode worker waited for KV after the prefill ended).

    python scripts/bench_disaggregation.py                # starts `pdserve serve` (1P + 1D)
    python scripts/bench_disaggregation.py --url http://127.0.0.1:8000
    python scripts/bench_disaggregation.py --lengths 1536 --serve-args '--dtype bfloat16'
"""

import argparse
import contextlib
import random
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from pdserve.bench.local_cluster import local_cluster
from pdserve.worker.processes import free_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running pdserve router (default: start one)")
    parser.add_argument("--lengths", default="128,512,1536", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=5, help="requests per path and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `pdserve serve` arguments for the cluster it starts, e.g. '--dtype bfloat16'",
    )
    args = parser.parse_args()
    if args.url:
        cluster = contextlib.nullcontext(args.url)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
        print(f"starting pdserve serve (1P + 1D; logs: {log_dir})", file=sys.stderr)
        cluster = local_cluster(1, 1, free_port(), log_dir, shlex.split(args.serve_args))
    with cluster as url:
        rows = [
            measure(url, int(n), args.repeats, random.Random(args.seed + int(n)))
            for n in args.lengths.split(",")
        ]
    print_table(rows, args.repeats)
    return 0


def measure(url: str, length: int, repeats: int, rng: random.Random) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    samples = {"local": [], "disaggregated": []}
    for i in range(repeats):
        for route in ("local", "disaggregated"):
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            response = httpx.post(
                f"{url}/v1/completions",
                timeout=300,
                headers={"x-pdserve-route": route, "x-pdserve-timing": "1"},
                json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
            )
            response.raise_for_status()
            samples[route].append(response.json()["pdserve_timing"])
            print(
                f"{length} tokens, {route} {i + 1}/{repeats}: "
                f"TTFT {samples[route][-1]['ttft']:.3f} s",
                file=sys.stderr,
            )
    local, disagg = samples["local"], samples["disaggregated"]

    def median(rows, key):
        return statistics.median(row[key] for row in rows)

    return {
        "length": length,
        "ttft_local": median(local, "ttft"),
        "ttft_disagg": median(disagg, "ttft"),
        "prefill": median(disagg, "prefill"),
        "kv_bytes": median(disagg, "kv_bytes"),
        "kv_seconds": median(disagg, "kv_seconds"),
        "exposed": median(disagg, "exposed_transfer"),
    }


def print_table(rows: list[dict], repeats: int) -> None:
    print(f"medians of {repeats} requests per path; TTFT measured at the router")
    header = (
        f"{'tokens':>6} {'TTFT local':>11} {'TTFT disagg':>12} {'ratio':>6} {'KV MiB':>7} "
        f"{'transfer s':>11} {'prefill s':>10} {'exposed s':>10} {'exposed/prefill':>16}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['length']:>6} {row['ttft_local']:>11.3f} {row['ttft_disagg']:>12.3f} "
            f"{row['ttft_disagg'] / row['ttft_local']:>6.2f} {row['kv_bytes'] / 2**20:>7.1f} "
            f"{row['kv_seconds']:>11.3f} {row['prefill']:>10.3f} {row['exposed']:>10.3f} "
            f"{row['exposed'] / row['prefill']:>15.1%}"
        )


if __name__ == "__main__":
    sys.exit(main())
