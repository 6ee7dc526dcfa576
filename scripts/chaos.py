"""A chaos soak: a steady mixed load on a Ray cluster (`pdserve up`, 2P2D by default, with a
second router over the same registry) while, in turn, a prefill worker and a decode worker are
killed (-9), a worker is frozen (SIGSTOP for --freeze-s), the second router is killed (and
started again), and Redis restarts. At the end it prints what was sent and lost, and whether
every baseline came back: the pools, the KV blocks in use, and, once the cluster is down, the
processes and /dev/shm.

    python scripts/chaos.py [--duration 900] [--kill-every 60] [--prefill 2] [--decode 2]
        [--concurrency 4] [--kv-cache-gib 0.5] [--freeze-s 10]

The load: --concurrency clients of pdserve/bench/chaos_load.py. The goal is 0 failed but those
whose client deadline (--request-timeout-s) passed. Exits 1 otherwise, or when
a baseline was not restored. Starts its own Ray head (fake GPUs) and Redis (with a password).
"""

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.chaos_load import Load
from pdserve.cluster import local_services
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.redis_url import PASSWORD_ENV
from pdserve.worker.processes import free_port, is_listening, spawn, stop_group

NAME = "chaos"
MODEL = "smollm2"
SHM = Path("/dev/shm")
HEAL_TIMEOUT_S = 600  # replacements load their engines in ~30-90 s each here
CLUSTER_FILE = """
name: {name}
model: {{path: smollm2, dtype: float32}}
engine: {{kv_cache_gib: {kv_cache_gib}}}
prefill: {{replicas: {prefill}, tensor_parallel_size: 1, gpu_type: H100-SXM}}
decode: {{replicas: {decode}, tensor_parallel_size: 1, gpu_type: H100-SXM,
          kv_failure_policy: recompute}}
transport: {{kind: auto, kv_timeout_s: 30}}
router: {{port: {port}, route_policy: length, disaggregate_min_tokens: 4}}
registry: {{url: "{redis}", heartbeat_s: 1.0}}
"""


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def pdserve(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pdserve.cluster.cli", *args]
    return subprocess.run(command, env=env, text=True, capture_output=True, timeout=timeout)


def worker_pids(role: str) -> list[int]:
    """The cluster's live worker processes of `role` (not their keepers)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        args = process.info["cmdline"] or []
        if "worker" not in args or "pdserve.cluster.process_keeper" in args:
            continue
        line = " ".join(args)
        if f'"cluster":"{NAME}"' in line and f'"role":"{role}"' in line:
            if process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
    return found


def node_processes() -> list[int]:
    """Worker and engine processes (they carry PDSERVE_NODE)."""
    found = []
    for process in psutil.process_iter():
        try:
            if "PDSERVE_NODE" in process.environ() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def metric(url: str, name: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def kv_blocks_used(url: str) -> int:
    rows = httpx.get(f"{url}/pdserve/workers", params={"fresh": True}, timeout=30).json()
    return sum(row.get("kv_blocks_used", 0) for row in rows["workers"])


def pools(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health", timeout=10).json().get("pools", {})
    except (httpx.HTTPError, ValueError):
        return {}


async def wait_healed(url: str, prefill: int, decode: int) -> float:
    started = time.monotonic()
    while time.monotonic() - started < HEAL_TIMEOUT_S:
        now = pools(url)
        if now.get("prefill") == prefill and now.get("decode") == decode:
            return time.monotonic() - started
        await asyncio.sleep(1)
    raise TimeoutError(f"the pools did not come back to {prefill}P{decode}D: {pools(url)}")


class Chaos:
    """The events, in turn, one every --kill-every seconds."""

    def __init__(self, args, services, router_b) -> None:
        self.args = args
        self.services = services  # what to restart: Redis's port and process group
        self.router_b = router_b  # (start, process) of the second router
        self.events: Counter = Counter()
        self.migrations = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        events = [self.kill_prefill, self.kill_decode, self.freeze, self.kill_router, self.redis]
        turn = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.args.kill_every)
                return
            except TimeoutError:
                pass
            event = events[turn % len(events)]
            turn += 1
            say(f"chaos: {event.__name__.replace('_', ' ')}")
            await event()

    async def kill_prefill(self) -> None:
        await self._kill("prefill")

    async def kill_decode(self) -> None:
        await self._kill("decode")

    async def _kill(self, role: str) -> None:
        pids = worker_pids(role)
        if pids:
            os.kill(random.choice(pids), signal.SIGKILL)
            self.events[f"kill -9 {role}"] += 1

    async def freeze(self) -> None:
        pids = worker_pids("decode") + worker_pids("prefill")
        if not pids:
            return
        pid = random.choice(pids)
        os.kill(pid, signal.SIGSTOP)
        self.events["SIGSTOP worker"] += 1
        await asyncio.sleep(self.args.freeze_s)
        os.kill(pid, signal.SIGCONT)

    async def kill_router(self) -> None:
        start, process = self.router_b
        self.migrations += metric(process.url, "pdserve_migrations_total")
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.events["kill -9 router"] += 1
        self.router_b = (start, await asyncio.to_thread(start))

    async def redis(self) -> None:
        port, group, log = self.services["redis"]
        stop_group(group)
        _, group = local_services.start_redis(log, os.environ[PASSWORD_ENV], port=port)
        self.services["redis"] = (port, group, log)
        self.events["Redis restart"] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=900, help="seconds of chaos")
    parser.add_argument("--kill-every", type=float, default=60, help="seconds between events")
    parser.add_argument("--calm-s", type=float, default=30, help="load before the chaos")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--freeze-s", type=float, default=10)
    parser.add_argument("--request-timeout-s", type=float, default=120)
    args = parser.parse_args()
    return asyncio.run(soak(args))


async def soak(args) -> int:
    folder = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    say(f"logs and state in {folder}")
    shm_before, processes_before = set(SHM.iterdir()), len(node_processes())
    os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)
    os.environ[SECRET_ENV] = secrets.token_urlsafe(32)
    redis_log = folder / "redis.log"
    redis_url, redis_group = local_services.start_redis(redis_log, os.environ[PASSWORD_ENV])
    services = {"redis": (int(redis_url.rsplit(":", 1)[1].split("/")[0]), redis_group, redis_log)}
    workers = args.prefill + args.decode
    address, ray_group = local_services.start_ray_head(8, workers, folder / "ray.log")
    config = folder / "cluster.yaml"
    port = free_port()
    config.write_text(
        CLUSTER_FILE.format(
            name=NAME,
            port=port,
            redis=redis_url,
            kv_cache_gib=args.kv_cache_gib,
            prefill=args.prefill,
            decode=args.decode,
        )
    )
    env = {**os.environ, "PDSERVE_STATE_DIR": str(folder / "state"), "RAY_AUTH_MODE": "disabled"}
    router_a = f"http://127.0.0.1:{port}"
    port_b = free_port()
    router_b_args = ["router", "--registry", redis_url, "--cluster", NAME, "--port", str(port_b)]

    def start_router_b():
        command = [sys.executable, "-m", "pdserve.cluster.cli", *router_b_args, "--model", MODEL]
        process = spawn(command, folder / "router-b.log", env)
        process.url = f"http://127.0.0.1:{port_b}"
        deadline = time.monotonic() + 120
        while not is_listening(port_b):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the second router did not start: {folder}/router-b.log")
            time.sleep(0.2)
        return process

    chaos = None
    try:
        say(f"pdserve up: {args.prefill}P{args.decode}D on Ray with {workers} fake GPUs")
        up = pdserve("up", "-f", str(config), "--address", address, env=env)
        if up.returncode != 0:
            say(f"pdserve up failed:\n{up.stderr[-4000:]}")
            return 1
        chaos = Chaos(args, services, (start_router_b, start_router_b()))
        load = Load([router_a, f"http://127.0.0.1:{port_b}"], MODEL, args.request_timeout_s)
        kv_baseline = kv_blocks_used(router_a)
        clients = [asyncio.create_task(load.client(i)) for i in range(args.concurrency)]
        say(f"load: {args.concurrency} clients; {args.calm_s:g} s calm, then chaos")
        await asyncio.sleep(args.calm_s)
        load.phase = "chaos"
        stop_chaos = asyncio.Event()
        events = asyncio.create_task(chaos.run(stop_chaos))
        started = time.monotonic()
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(min(30, args.duration))
            say(f"{time.monotonic() - started:.0f} s: {dict(load.outcomes)} {dict(load.failures)}")
        stop_chaos.set()
        await events
        try:
            healed_s = await wait_healed(router_a, args.prefill, args.decode)
        except TimeoutError as error:
            say(str(error))
            healed_s = float("nan")
        load.stop.set()
        await asyncio.gather(*clients)
        settle = time.monotonic()
        while (kv_now := kv_blocks_used(router_a)) > kv_baseline and time.monotonic() - settle < 30:
            await asyncio.sleep(1)
        migrations = chaos.migrations + sum(
            metric(url, "pdserve_migrations_total") for url in (router_a, load.routers[1])
        )
        retried = load.outcomes["retried"]
        failed = sum(load.failures.values())
        ok = failed == 0 and kv_now <= kv_baseline and healed_s == healed_s
    finally:
        if chaos is not None:
            stop_group(chaos.router_b[1].pid, process=chaos.router_b[1])
        down = pdserve("down", "-f", str(config), env=env, timeout=300)
        stop_group(ray_group)
        stop_group(services["redis"][1])
        if down.returncode != 0:
            say(f"pdserve down failed:\n{down.stderr[-2000:]}")
    deadline = time.monotonic() + 30
    while (left := len(node_processes())) > processes_before and time.monotonic() < deadline:
        time.sleep(0.5)
    shm_left = sorted(p.name for p in set(SHM.iterdir()) - shm_before)
    calm, busy = load.latencies["calm"], load.latencies["chaos"]
    p99 = lambda xs: statistics.quantiles(xs, n=100)[98] if len(xs) > 1 else float("nan")  # noqa: E731
    sent = sum(load.outcomes.values())
    rows = [
        ("chaos", f"{args.duration:g} s, an event every {args.kill_every:g} s"),
        ("events", json.dumps(dict(chaos.events))),
        ("requests sent", sent),
        ("succeeded", load.outcomes["succeeded"] + retried),
        ("  of them retried at the other router", retried),
        ("aborted by their client (as asked)", load.outcomes["aborted"]),
        ("deadline passed", load.outcomes["deadline passed"]),
        ("failed", f"{failed} {json.dumps(dict(load.failures)) if failed else ''}"),
        ("migrated (router counters)", f"{migrations:g}"),
        ("whole-response latency p99, calm -> chaos", f"{p99(calm):.2f} s -> {p99(busy):.2f} s"),
        ("pools back to the layout after", f"{healed_s:.0f} s"),
        ("KV blocks in use, baseline -> end", f"{kv_baseline} -> {kv_now}"),
        ("worker processes, before -> after down", f"{processes_before} -> {left}"),
        ("new /dev/shm files after down", f"{len(shm_left)} {shm_left or ''}"),
    ]
    print()
    for name, value in rows:
        print(f"{name:45} {value}")
    return 0 if ok and left <= processes_before and not shm_left else 1


if __name__ == "__main__":
    sys.exit(main())
