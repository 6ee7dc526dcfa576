"""Admission at 10x capacity, before and after --max-queue-wait: how long the admitted requests
waited for their first token, and how many got 429 (and how fast).

    python scripts/bench_admission.py [--capacity 4] [--times 10] [--max-queue-wait 3]
        [--max-tokens 32] [--serve-args "--kv-cache-gib 1"]

Starts `pdserve serve` 1P1D with --max-concurrent-requests CAPACITY and a queue that holds the
whole burst (--max-queued-requests TIMES x CAPACITY, --queue-timeout 120), sends TIMES x CAPACITY
streaming requests at once (half of class 0, half of class 1 by x-pdserve-priority), stops it;
then the same with --max-queue-wait. Prints one table. Takes a few minutes (two cluster starts).
"""

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.local_cluster import local_cluster
from pdserve.bench.metrics import percentile
from pdserve.bench.runner import run_jobs
from pdserve.worker.processes import free_port

MODEL = "smollm2"  # the name the clusters serve
CLASSES = (0, 1)  # x-pdserve-priority: request i is of class i % 2


async def one(http: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> tuple:
    """(status, class, seconds to the first token or to the refusal, Retry-After)."""
    priority = CLASSES[i % len(CLASSES)]
    body = {
        "model": MODEL,
        "prompt": f"Request {i}: tell me about the weather in a city you like,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    started = time.monotonic()
    headers = {"x-pdserve-priority": str(priority)}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return (
                reply.status_code,
                priority,
                time.monotonic() - started,
                reply.headers.get("retry-after"),
            )
        first = None
        async for line in reply.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
        return 200, priority, first, None


async def burst(url: str, count: int, max_tokens: int) -> list[tuple]:
    results: list[tuple] = [()] * count

    async def send(i: int) -> None:
        results[i] = await one(http, url, i, max_tokens)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as http:
        await one(http, url, 0, 2)  # warm: the learned costs exist before the burst
        await run_jobs(send, offsets=[0.0] * count)  # all at once
    return results


def row(name: str, results: list[tuple], wall_s: float) -> str:
    admitted = [seconds for status, _, seconds, _ in results if status == 200]
    refused = [r for r in results if r[0] == 429]
    others = [r[0] for r in results if r[0] not in (200, 429)]
    by_class = "/".join(str(sum(r[1] == c for r in refused)) for c in CLASSES)
    refused_in = percentile([r[2] for r in refused], 99)
    retry = sorted({int(r[3]) for r in refused if r[3]})
    return (
        f"| {name} | {len(results)} | {len(admitted)} | {len(refused)} ({by_class}) "
        f"| {percentile(admitted, 50):.2f} | {percentile(admitted, 99):.2f} | {refused_in:.2f} "
        f"| {retry[0] if retry else '-'}-{retry[-1] if retry else '-'} | {others or '-'} "
        f"| {wall_s:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=4)
    parser.add_argument("--times", type=int, default=10)
    parser.add_argument("--max-queue-wait", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--serve-args", default="--kv-cache-gib 1")
    args = parser.parse_args()
    count = args.times * args.capacity
    bounds = [
        "--max-concurrent-requests",
        str(args.capacity),
        "--max-queued-requests",
        str(count),
        "--queue-timeout",
        "120",
    ]
    phases = {
        "before (no limit)": bounds,
        f"after (--max-queue-wait {args.max_queue_wait:g})": [
            *bounds,
            "--max-queue-wait",
            str(args.max_queue_wait),
        ],
    }
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as folder:
        for number, (name, router_args) in enumerate(phases.items()):
            serve_args = [*shlex.split(args.serve_args), "--served-model-name", MODEL]
            log_dir = Path(folder) / str(number)
            with local_cluster(1, 1, free_port(), log_dir, [*serve_args, *router_args]) as url:
                started = time.monotonic()
                results = asyncio.run(burst(url, count, args.max_tokens))
                lines.append(row(name, results, time.monotonic() - started))
    print(
        f"{count} streaming requests at once ({args.times}x --max-concurrent-requests "
        f"{args.capacity}), 1P1D, {args.max_tokens} tokens each, classes 0/1 alternating"
    )
    print(
        "| router | sent | 200 | 429 (class 0/1) | admitted TTFT p50 s | admitted TTFT p99 s "
        "| 429 answered in p99 s | Retry-After s | other | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
