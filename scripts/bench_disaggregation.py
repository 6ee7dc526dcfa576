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
    python scripts/bench_disaggregation.py --integrity on,off   # two clusters, side by side

With `--integrity on,off` it starts one cluster per setting of `--kv-integrity` and sends each
request to both in turn, so the integrity check's cost shows against the same noise.
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
    parser.add_argument(
        "--integrity",
        default="",
        help="settings of --kv-integrity to compare, one cluster each, e.g. on,off "
        "(default: one cluster, as --serve-args has it)",
    )
    args = parser.parse_args()
    settings = [s for s in args.integrity.split(",") if s] or [None]
    if args.url and settings != [None]:
        parser.error("--integrity compares clusters it starts: not with --url")
    with contextlib.ExitStack() as stack:
        urls = {}
        for setting in settings:
            if args.url:
                urls[setting] = args.url
                continue
            serve_args = shlex.split(args.serve_args)
            if setting is not None:
                serve_args += ["--kv-integrity", setting]
            log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
            print(
                f"starting pdserve serve (1P + 1D {serve_args}; logs: {log_dir})", file=sys.stderr
            )
            urls[setting] = stack.enter_context(
                local_cluster(1, 1, free_port(), log_dir, serve_args)
            )
        rows = [
            row
            for n in args.lengths.split(",")
            for row in measure(urls, int(n), args.repeats, random.Random(args.seed + int(n)))
        ]
    print_table(rows, args.repeats)
    return 0


def measure(urls: dict, length: int, repeats: int, rng: random.Random) -> list[dict]:
    """Each cluster's medians at `length`: every prompt goes to every cluster, on both paths."""
    samples = {(setting, route): [] for setting in urls for route in ("local", "disaggregated")}
    models = {
        s: httpx.get(f"{u}/v1/models", timeout=10).json()["data"][0]["id"] for s, u in urls.items()
    }
    for i in range(repeats):
        for route in ("local", "disaggregated"):
            prompt = [rng.randrange(100, 40000) for _ in range(length)]
            for setting, url in urls.items():
                response = httpx.post(
                    f"{url}/v1/completions",
                    timeout=300,
                    headers={"x-pdserve-route": route, "x-pdserve-timing": "1"},
                    json={
                        "model": models[setting],
                        "prompt": prompt,
                        "max_tokens": 2,
                        "temperature": 0,
                    },
                )
                response.raise_for_status()
                samples[setting, route].append(response.json()["pdserve_timing"])
                print(
                    f"{length} tokens, {route} {i + 1}/{repeats} (integrity {setting or '-'}): "
                    f"TTFT {samples[setting, route][-1]['ttft']:.3f} s",
                    file=sys.stderr,
                )
    return [
        summary(setting, length, samples[setting, "local"], samples[setting, "disaggregated"])
        for setting in urls
    ]


def summary(setting, length: int, local: list[dict], disagg: list[dict]) -> dict:
    def median(rows, key):
        return statistics.median(row[key] for row in rows)

    return {
        "integrity": setting or "-",
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
        f"{'integrity':>9} {'tokens':>6} {'TTFT local':>11} {'TTFT disagg':>12} {'ratio':>6} "
        f"{'KV MiB':>7} "
        f"{'transfer s':>11} {'prefill s':>10} {'exposed s':>10} {'exposed/prefill':>16} "
        f"{'exposed/TTFT':>13}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['integrity']:>9} {row['length']:>6} {row['ttft_local']:>11.3f} "
            f"{row['ttft_disagg']:>12.3f} "
            f"{row['ttft_disagg'] / row['ttft_local']:>6.2f} {row['kv_bytes'] / 2**20:>7.1f} "
            f"{row['kv_seconds']:>11.3f} {row['prefill']:>10.3f} {row['exposed']:>10.3f} "
            f"{row['exposed'] / row['prefill']:>15.1%} {row['exposed'] / row['ttft_disagg']:>13.2%}"
        )


if __name__ == "__main__":
    sys.exit(main())
