"""Two routers side by side, for a change's effect on a busy host: the router of this checkout
and the router of another (`--baseline DIR`, a checkout or `git archive` of the commit before),
both pinned to core 0, in front of the same fake workers (pdserve/bench/fake_worker.py), offered
the same load at the same time by one client. Whatever else the host runs slows both alike, so
each round's ratio of their CPU per request (or per streamed token) holds where a run against
a run a minute later does not (scripts/bench_router.py's numbers moved by 10-40% between two runs
of one commit while a test suite shared the host).

    python scripts/bench_router_pair.py --baseline /tmp/router-base [--rounds 5]
        [--rate 100] [--streams 100] [--duration-s 6] [--stream-tokens 200]

Per round: short completions (max_tokens 1) at `--rate` to each router, then `--streams`
concurrent streams to each; the router CPU per request and per token of each, and the ratio
this/baseline. The medians close it. The CPU comes from /proc in clock ticks (10 ms): a phase
must use a few seconds of CPU for a ratio within 1%.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
from bench_router import (
    cpu_seconds,
    open_loop,
    router_settings,
    start_fake_workers,
    stream_body,
    wait_ready,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.metrics import percentile
from pdserve.bench.runner import run_jobs
from pdserve.worker.processes import free_port, stop_group

HERE = Path(__file__).resolve().parents[1]


def start_router(tree: Path, settings: dict, log: Path) -> subprocess.Popen:
    """`tree`'s router (its own code, this Python environment) on core 0."""

    def pin() -> None:
        os.setsid()
        os.sched_setaffinity(0, {0})

    command = [sys.executable, "-m", "pdserve.cli", "router", "--settings-json"]
    return subprocess.Popen(
        [*command, json.dumps(settings)],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=str(tree)),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=pin,
    )


async def short_round(args, session, urls: list[str], routers: list) -> list[dict]:
    body = {"model": "smollm2", "prompt": "Hello, how are you?", "max_tokens": 1}

    def via(url: str):
        async def one() -> None:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(response.status)

        return one

    before = [cpu_seconds(router) for router in routers]
    runs = await asyncio.gather(*(open_loop(args.rate, args.duration_s, via(u)) for u in urls))
    used = [cpu_seconds(router) - b for router, b in zip(routers, before, strict=True)]
    return [
        {
            "cpu_ms_per_request": round(1000 * cpu / max(len(latencies), 1), 3),
            "achieved_rps": round(len(latencies) / wall, 1),
            "errors": errors,
            "p99_ms": round(1000 * percentile(latencies, 99), 1),
        }
        for cpu, (latencies, errors, wall) in zip(used, runs, strict=True)
    ]


async def stream_round(args, session, urls: list[str], routers: list) -> list[dict]:
    body = stream_body(args.stream_tokens)
    tokens = [0] * len(urls)

    def stream(index: int):
        async def one(_: int) -> None:
            async with session.post(f"{urls[index]}/v1/completions", json=body) as reply:
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        tokens[index] += 1

        return one

    before, began = [cpu_seconds(router) for router in routers], time.perf_counter()
    deadline = began + args.duration_s
    await asyncio.gather(
        *(
            run_jobs(stream(i), concurrency=args.streams, start=began, deadline=deadline)
            for i in range(len(urls))
        )
    )
    wall = time.perf_counter() - began
    used = [cpu_seconds(router) - b for router, b in zip(routers, before, strict=True)]
    return [
        {
            "cpu_us_per_token": round(1e6 * cpu / max(count, 1), 1),
            "tokens_per_s": round(count / wall),
        }
        for cpu, count in zip(used, tokens, strict=True)
    ]


def summary(rounds: list[list[dict]], key: str) -> str:
    this = [row[0][key] for row in rounds]
    base = [row[1][key] for row in rounds]
    ratios = [t / b for t, b in zip(this, base, strict=True)]
    return (
        f"{key}: this {statistics.median(this)}, baseline {statistics.median(base)} (medians); "
        f"this/baseline per round {[round(r, 3) for r in ratios]}, "
        f"median {statistics.median(ratios):.3f}"
    )


async def run(args) -> None:
    logs = Path(args.log_dir)
    ports, others, fakes = start_fake_workers(2, args.token_interval_s, logs)
    routers, urls = [], []
    for name, tree in (("this", HERE), ("baseline", Path(args.baseline).resolve())):
        port = free_port()
        settings = router_settings(port, ports)
        routers.append(start_router(tree, settings, logs / f"router-{name}.log"))
        urls.append(f"http://127.0.0.1:{port}")
    os.sched_setaffinity(0, others)
    try:
        for url in urls:
            await wait_ready(f"{url}/health")
        processes = [psutil.Process(router.pid) for router in routers]
        short, streamed = [], []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            args_warm = argparse.Namespace(**{**vars(args), "rate": 50, "duration_s": 1})
            await short_round(args_warm, session, urls, processes)  # connections, the tokenizer
            for number in range(args.rounds):
                short.append(await short_round(args, session, urls, processes))
                print(json.dumps({"round": number, "short": short[-1]}), flush=True)
                streamed.append(await stream_round(args, session, urls, processes))
                print(json.dumps({"round": number, "streams": streamed[-1]}), flush=True)
        print(
            f"\nshort completions at {args.rate:g}/s each: " + summary(short, "cpu_ms_per_request")
        )
        print(f"{args.streams} streams each: " + summary(streamed, "cpu_us_per_token"))
    finally:
        for child in (*routers, fakes):
            stop_group(child.pid, grace_s=5, process=child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's root")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--token-interval-s", type=float, default=0.01)
    parser.add_argument("--log-dir", default="/tmp/bench_router_pair")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
