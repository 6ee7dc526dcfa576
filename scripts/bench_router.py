"""How much traffic one router process carries: the real router (pinned to one core) in front of
fake workers (pdserve/bench/fake_worker.py: real gRPC servers that run no engine), driven open
loop by one client, and the same client calling a fake worker directly for the latency the
router adds.

    python scripts/bench_router.py [--rates 100,200,400,800] [--duration-s 5]
        [--streams 50,200] [--stream-tokens 200] [--token-interval-s 0.01] [--workers 2]
        [--api-key]

Per request rate (short completions, max_tokens 1): the achieved rate, the router's CPU per
request (its process's CPU time over the requests it served), and latency p50/p99 through the
router, directly, and the difference. Per number of concurrent streams (each --stream-tokens
tokens, one every --token-interval-s): streamed tokens/s at the client and the router's CPU per
token. The router runs on core 0, the fakes and the client on the others: with two cores the
client shares one with the fakes, so a rate it cannot offer shows as achieved < offered with the
router's CPU below one core (then the router is not the limit). Numbers print as a table.
`--api-key`: the router guards its API with a key (router/http/api_keys.py) and the client sends it,
for what the check costs.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.metrics import percentile
from pdserve.bench.runner import run_jobs
from pdserve.model_store.store import ensure_model
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.worker.processes import free_port, stop_group

READY_TIMEOUT_S = 120
API_KEY = "sk-bench-router"


def start(command: list[str], cores: set[int], log: Path) -> subprocess.Popen:
    def pin() -> None:
        os.setsid()
        os.sched_setaffinity(0, cores)

    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=pin)


def start_fake_workers(
    count: int, token_interval_s: float, logs: Path
) -> tuple[list[int], set[int], subprocess.Popen]:
    """`count` fake workers (pdserve/bench/fake_worker.py, one process) on every core but the
    router's (0): their ports, those cores, and the process."""
    logs.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(count)]
    cores = set(range(1, os.cpu_count() or 2)) or {0}
    command = [sys.executable, "-m", "pdserve.bench.fake_worker"]
    command += [item for port in ports for item in ("--port", str(port))]
    command += ["--token-interval-s", str(token_interval_s)]
    return ports, cores, start(command, cores, logs / "fake-workers.log")


def router_settings(port: int, worker_ports: list[int]) -> dict:
    """A router on `port` in front of the fake workers, with SmolLM2's tokenizer."""
    return {
        "port": port,
        "model": str(ensure_model("smollm2")),
        "served_model_name": "smollm2",
        "worker_addresses": [f"127.0.0.1:{worker}" for worker in worker_ports],
    }


async def wait_ready(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {READY_TIMEOUT_S} s")


async def open_loop(rate: float, duration_s: float, one_request) -> tuple[list[float], int, float]:
    """Start one_request() every 1/rate s for duration_s; (latencies, errors, wall seconds)."""
    latencies, errors = [], 0

    async def timed(_: int) -> None:
        nonlocal errors
        began = time.perf_counter()
        try:
            await one_request()
            latencies.append(time.perf_counter() - began)
        except Exception:  # counted: a benchmark reports failures, it does not stop on them
            errors += 1

    began = time.perf_counter()
    await run_jobs(timed, offsets=[i / rate for i in range(int(rate * duration_s))], start=began)
    return latencies, errors, time.perf_counter() - began


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def client_headers(args) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"} if args.api_key else {}


async def short_completions(args, router_url: str, worker: str, router: psutil.Process) -> list:
    rows = []
    body = {"model": "smollm2", "prompt": "Hello, how are you?", "max_tokens": 1}
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        aiohttp.ClientSession(connector=connector, headers=client_headers(args)) as session,
        grpc.aio.insecure_channel(worker) as channel,
    ):
        stub = worker_pb2_grpc.WorkerStub(channel)

        async def via_router() -> None:
            async with session.post(f"{router_url}/v1/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(response.status)

        async def direct() -> None:
            request = worker_pb2.GenerateRequest(
                request_id=os.urandom(8).hex(),
                prompt_token_ids=[1, 2, 3, 4, 5, 6],
                sampling=worker_pb2.SamplingParams(max_tokens=1),
            )
            async for _ in stub.Generate(request, timeout=30):
                pass

        await open_loop(50, 1, via_router)  # warm: connections, the tokenizer
        for rate in args.rates:
            before = cpu_seconds(router)
            latencies, errors, wall = await open_loop(rate, args.duration_s, via_router)
            used = cpu_seconds(router) - before
            direct_latencies, _, _ = await open_loop(rate, args.duration_s, direct)
            served = len(latencies)
            rows.append(
                {
                    "offered_rps": rate,
                    "achieved_rps": round(served / wall, 1),
                    "errors": errors,
                    "router_cpu_core": round(used / wall, 2),
                    "router_cpu_ms_per_request": round(1000 * used / max(served, 1), 3),
                    "p50_ms": round(1000 * percentile(latencies, 50), 2),
                    "p99_ms": round(1000 * percentile(latencies, 99), 2),
                    "direct_p50_ms": round(1000 * percentile(direct_latencies, 50), 2),
                    "direct_p99_ms": round(1000 * percentile(direct_latencies, 99), 2),
                }
            )
            row = rows[-1]
            row["added_p50_ms"] = round(row["p50_ms"] - row["direct_p50_ms"], 2)
            row["added_p99_ms"] = round(row["p99_ms"] - row["direct_p99_ms"], 2)
            print(json.dumps(row), flush=True)
    return rows


def stream_body(tokens: int) -> dict:
    """A streamed completion of `tokens` tokens (the fake workers make them)."""
    body = {"model": "smollm2", "prompt": "Hello", "max_tokens": tokens, "stream": True}
    return {**body, "ignore_eos": True}


async def streams(args, router_url: str, router: psutil.Process) -> list:
    rows = []
    body = stream_body(args.stream_tokens)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=client_headers(args)) as session:
        for concurrency in args.streams:
            tokens = 0

            async def stream(_: int) -> None:
                nonlocal tokens
                async with session.post(f"{router_url}/v1/completions", json=body) as reply:
                    async for line in reply.content:
                        if line.startswith(b"data: {"):
                            tokens += 1

            before, began = cpu_seconds(router), time.perf_counter()
            deadline = began + args.duration_s
            await run_jobs(stream, concurrency=concurrency, start=began, deadline=deadline)
            wall = time.perf_counter() - began
            used = cpu_seconds(router) - before
            rows.append(
                {
                    "streams": concurrency,
                    # unpaced fakes (--token-interval-s 0) send as fast as they go
                    "offered_tokens_per_s": (
                        round(concurrency / args.token_interval_s)
                        if args.token_interval_s
                        else "unpaced"
                    ),
                    "tokens_per_s": round(tokens / wall),
                    "router_cpu_core": round(used / wall, 2),
                    "router_cpu_us_per_token": round(1e6 * used / max(tokens, 1), 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_tables(short: list, streamed: list) -> None:
    print("\nshort completions (max_tokens 1), one router process on one core")
    print("offered  achieved  errors  router CPU  ms CPU/req  p50 ms  p99 ms  added p50  added p99")
    for r in short:
        print(
            f"{r['offered_rps']:7}  {r['achieved_rps']:8}  {r['errors']:6}  "
            f"{r['router_cpu_core']:10}  {r['router_cpu_ms_per_request']:10}  {r['p50_ms']:6}  "
            f"{r['p99_ms']:6}  {r['added_p50_ms']:9}  {r['added_p99_ms']:9}"
        )
    print("\nstreams")
    print("streams  offered tok/s  tok/s  router CPU  us CPU/token")
    for r in streamed:
        print(
            f"{r['streams']:7}  {r['offered_tokens_per_s']:13}  {r['tokens_per_s']:5}  "
            f"{r['router_cpu_core']:10}  {r['router_cpu_us_per_token']:12}"
        )


async def run(args) -> None:
    logs = Path(args.log_dir)
    ports, others, fakes = start_fake_workers(args.workers, args.token_interval_s, logs)
    router_port = free_port()
    settings = router_settings(router_port, ports)
    settings["api_key"] = [API_KEY] if args.api_key else []
    router_command = [sys.executable, "-m", "pdserve.cli", "router"]
    router_command += ["--settings-json", json.dumps(settings)]
    router = start(router_command, {0}, logs / "router.log")
    os.sched_setaffinity(0, others)
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        await wait_ready(f"{router_url}/health")
        process = psutil.Process(router.pid)
        short = await short_completions(args, router_url, f"127.0.0.1:{ports[0]}", process)
        streamed = await streams(args, router_url, process)
        print_tables(short, streamed)
    finally:
        for child in (router, fakes):
            stop_group(child.pid, grace_s=5, process=child)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates",
        type=lambda s: [float(r) for r in s.split(",")],
        default=[100.0, 200.0, 400.0, 800.0],
    )
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument(
        "--streams", type=lambda s: [int(n) for n in s.split(",")], default=[50, 200]
    )
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--token-interval-s", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--log-dir", default="/tmp/bench_router")
    parser.add_argument(
        "--api-key", action="store_true", help="the router checks an API key on every request"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
