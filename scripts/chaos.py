"""A chaos soak: a steady mixed load on a cluster with two routers while, in turn, a worker is
killed (-9), a worker is frozen (SIGSTOP for --freeze-s), the second router is killed (and
started again), and Redis restarts. At the end it prints what was sent and lost, and whether
every baseline came back: the pools, the KV blocks in use, the worker processes and /dev/shm.

    python scripts/chaos.py [--duration 900] [--kill-every 60] [--prefill 2] [--decode 2 | --flex 4]
        [--concurrency 4] [--kv-cache-gib 0.5] [--freeze-s 10] [--events kill,freeze,router,redis]
    python scripts/chaos.py --serve-args "--prefill 1 --decode 2" [...]
    python scripts/chaos.py --url http://a:8000[,http://b:8000] --cluster NAME [...]

Which cluster:
- by default its own: a Ray head (fake GPUs), Redis (with a password) and `pdserve up` of
  --prefill/--decode workers (or --flex flex workers, which the killed ones are then among),
  plus a second router over the same registry. The replica keeper replaces killed workers.
- --serve-args: `pdserve serve --routers 2 ARGS` (its second router is the one killed). `serve`
  replaces no worker, so its events are the freeze and the router kill, not worker kills; its
  Redis (shared state) is its own, so no Redis restart either.
- --url: a running cluster's routers (one or two, comma-separated): workers of --cluster NAME
  on this host are killed and frozen; its routers and Redis are not this script's to restart.
  Kill workers only where something replaces them (`pdserve up`), or the pools cannot come back.

The load: --concurrency clients of pdserve/bench/chaos_load.py. The goal is 0 failed but those
whose client deadline (--request-timeout-s) passed. Exits 1 otherwise, or when a baseline was
not restored.
"""

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.chaos_load import Load
from pdserve.bench.metrics import percentile
from pdserve.cluster import local_services
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.redis_url import PASSWORD_ENV
from pdserve.worker.processes import free_port, is_listening, spawn, stop_group

NAME = "chaos"
MODEL = "smollm2"
SHM = Path("/dev/shm")
EVENTS = ("kill", "freeze", "router", "redis")
HEAL_TIMEOUT_S = 600  # replacements load their engines in ~30-90 s each here
START_TIMEOUT_S = 900
CLUSTER_FILE = """
name: {name}
model: {{path: smollm2, dtype: float32}}
engine: {{kv_cache_gib: {kv_cache_gib}}}
{pools}
transport: {{kind: auto, kv_timeout_s: 30}}
router: {{port: {port}, route_policy: length, disaggregate_min_tokens: 4}}
registry: {{url: "{redis}", heartbeat_s: 1.0}}
"""
FIXED_POOLS = """prefill: {{replicas: {prefill}, tensor_parallel_size: 1, gpu_type: H100-SXM}}
decode: {{replicas: {decode}, tensor_parallel_size: 1, gpu_type: H100-SXM,
          kv_failure_policy: recompute}}"""
FLEX_POOLS = """flex: {{replicas: {flex}, tensor_parallel_size: 1, gpu_type: H100-SXM,
        kv_failure_policy: recompute}}"""


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def pdserve(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pdserve.cli", *args]
    return subprocess.run(command, env=env, text=True, capture_output=True, timeout=timeout)


def worker_pids(candidates, role: str, cluster: str | None = None) -> list[int]:
    """Of `candidates` (psutil processes), the live workers of `role` (of `cluster`, when
    given), not their keepers."""
    found = []
    for process in candidates:
        try:
            args = process.cmdline()
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        line = " ".join(args)
        if (
            "--settings-json" in args
            and "pdserve.cluster.process_keeper" not in args
            and f'"role":"{role}"' in line
            and (cluster is None or f'"cluster":"{cluster}"' in line)
        ):
            found.append(process.pid)
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


def layout(url: str, flex: bool) -> tuple:
    """What must come back: (prefill, decode) workers, or their total for flex workers (the
    split may move between prefill and decode)."""
    now = pools(url)
    serving = (now.get("prefill", 0), now.get("decode", 0))
    return (sum(serving),) if flex else serving


async def wait_healed(url: str, baseline: tuple, flex: bool) -> float:
    started = time.monotonic()
    while time.monotonic() - started < HEAL_TIMEOUT_S:
        if layout(url, flex) == baseline:
            return time.monotonic() - started
        await asyncio.sleep(1)
    raise TimeoutError(f"the pools did not come back to {baseline}: {pools(url)}")


class RayCluster:
    """This script's own cluster: a Ray head, Redis, `pdserve up`, and a second router over
    the registry."""

    events = EVENTS

    def __init__(self, args, folder: Path) -> None:
        self.args, self.folder = args, folder
        self.flex = args.flex > 0
        self.roles = ["flex"] if self.flex else ["prefill", "decode"]
        os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)
        os.environ[SECRET_ENV] = secrets.token_urlsafe(32)
        self.redis_log = folder / "redis.log"
        self.redis_url, self.redis_group = local_services.start_redis(
            self.redis_log, os.environ[PASSWORD_ENV]
        )
        self.redis_port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        workers = args.flex or args.prefill + args.decode
        self.ray_address, self.ray_group = local_services.start_ray_head(
            8, workers, folder / "ray.log"
        )
        self.config = folder / "cluster.yaml"
        port = free_port()
        shape = (
            FLEX_POOLS.format(flex=args.flex)
            if self.flex
            else FIXED_POOLS.format(prefill=args.prefill, decode=args.decode)
        )
        self.config.write_text(
            CLUSTER_FILE.format(
                name=NAME,
                pools=shape,
                port=port,
                redis=self.redis_url,
                kv_cache_gib=args.kv_cache_gib,
            )
        )
        self.env = {
            **os.environ,
            "PDSERVE_STATE_DIR": str(folder / "state"),
        }
        self.port_b = free_port()
        self.routers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{self.port_b}"]
        self.router_b = None

    def start(self) -> None:
        say(f"pdserve up: {self.shape()} on Ray with fake GPUs")
        up = pdserve("up", "-f", str(self.config), "--address", self.ray_address, env=self.env)
        if up.returncode != 0:
            raise RuntimeError(f"pdserve up failed:\n{up.stderr[-4000:]}")
        self.router_b = self._start_router_b()

    def shape(self) -> str:
        args = self.args
        return f"{args.flex} flex" if self.flex else f"{args.prefill}P{args.decode}D"

    def _start_router_b(self):
        command = [
            sys.executable, "-m", "pdserve.cli", "router", "--registry", self.redis_url,
            "--cluster", NAME, "--port", str(self.port_b), "--model", MODEL,
        ]  # fmt: skip
        process = spawn(command, self.folder / "router-b.log", self.env)
        deadline = time.monotonic() + 120
        while not is_listening(self.port_b):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the second router did not start: {self.folder}/router-b.log")
            time.sleep(0.2)
        return process

    def worker_pids(self, role: str) -> list[int]:
        return worker_pids(psutil.process_iter(), role, NAME)

    def restart_router(self) -> None:
        os.killpg(self.router_b.pid, signal.SIGKILL)
        self.router_b.wait()
        self.router_b = self._start_router_b()

    def restart_redis(self) -> None:
        stop_group(self.redis_group)
        _, self.redis_group = local_services.start_redis(
            self.redis_log, os.environ[PASSWORD_ENV], port=self.redis_port
        )

    def stop(self) -> None:
        if self.router_b is not None:
            stop_group(self.router_b.pid, process=self.router_b)
        down = pdserve("down", "-f", str(self.config), env=self.env, timeout=300)
        local_services.stop_ray_head(self.ray_group)
        stop_group(self.redis_group)
        if down.returncode != 0:
            say(f"pdserve down failed:\n{down.stderr[-2000:]}")


class ServedCluster:
    """`pdserve serve --routers 2 ARGS`: its second router is the one killed (and started
    again with its own command line); it replaces no worker, so none is killed."""

    events = ("freeze", "router")

    def __init__(self, args, folder: Path) -> None:
        self.args, self.folder = args, folder
        extra = shlex.split(args.serve_args)
        self.flex = "--flex" in extra
        self.roles = ["flex"] if self.flex else ["prefill", "decode"]
        port = free_port()
        while is_listening(port + 1):  # serve's second router listens on --port + 1
            port = free_port()
        self.command = [
            sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port),
            "--routers", "2", "--log-dir", str(folder), *extra,
        ]  # fmt: skip
        self.routers = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        self.serve = None
        self.router_b = None
        self.restarted = None  # the second router, once this script started it again

    def start(self) -> None:
        say(f"pdserve serve --routers 2 {self.args.serve_args}")
        self.serve = spawn(self.command, self.folder / "serve.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(pools(url) for url in self.routers):
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve serve did not start: {self.folder}/serve.log")
            time.sleep(1)
        self.router_b = self._router_b_process()

    def _router_b_process(self) -> psutil.Process:
        port = self.routers[1].rsplit(":", 1)[1]
        for process in psutil.Process(self.serve.pid).children(recursive=True):
            line = " ".join(process.cmdline())
            if " router " in f" {line} " and f'"port":{port}' in line:
                return process
        raise RuntimeError(f"no router on port {port} under pdserve serve")

    def worker_pids(self, role: str) -> list[int]:
        return worker_pids(psutil.Process(self.serve.pid).children(recursive=True), role)

    def restart_router(self) -> None:
        # Its command line and environment (serve's Redis password, the cluster secret).
        command, env = self.router_b.cmdline(), self.router_b.environ()
        port = int(self.routers[1].rsplit(":", 1)[1])
        os.killpg(self.router_b.pid, signal.SIGKILL)
        if self.restarted is not None:
            self.restarted.wait(timeout=10)  # reaped: it is this script's child
        deadline = time.monotonic() + 10  # serve reaps its own only when it stops: the port
        while is_listening(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        process = spawn(command, self.folder / "router-b-again.log", env)
        deadline = time.monotonic() + 120
        while not is_listening(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the second router did not start: {self.folder}")
            time.sleep(0.2)
        self.router_b = psutil.Process(process.pid)
        self.restarted = process

    def stop(self) -> None:
        if self.restarted is not None:
            stop_group(self.restarted.pid, process=self.restarted)
        if self.serve is not None:
            stop_group(self.serve.pid, process=self.serve)


class AttachedCluster:
    """A running cluster's routers (--url): its workers of --cluster on this host are killed
    and frozen; its routers and Redis are left alone."""

    events = ("kill", "freeze")

    def __init__(self, args, folder: Path) -> None:
        self.args = args
        self.routers = args.url.split(",")
        if len(self.routers) == 1:
            self.routers *= 2  # the load's clients alternate between two routers
        self.flex = bool(self.worker_pids("flex"))
        self.roles = ["flex"] if self.flex else ["prefill", "decode"]

    def start(self) -> None:
        if not pools(self.routers[0]):
            raise RuntimeError(f"no router answers at {self.routers[0]}")

    def worker_pids(self, role: str) -> list[int]:
        return worker_pids(psutil.process_iter(), role, self.args.cluster)

    def stop(self) -> None:
        pass


class Chaos:
    """The events, in turn, one every --kill-every seconds."""

    def __init__(self, args, cluster, events: list[str]) -> None:
        self.args = args
        self.cluster = cluster
        by_event = {  # only events the cluster's kind allows get here (soak checks)
            "kill": [(f"kill -9 {role}", partial(self.kill, role)) for role in cluster.roles],
            "freeze": [("SIGSTOP worker", self.freeze)],
            "router": [("kill -9 router", self.kill_router)],
            "redis": [("Redis restart", self.redis)],
        }
        self.turns = [turn for event in EVENTS if event in events for turn in by_event[event]]
        self.events: Counter = Counter()
        self.migrations = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        turn = 0
        while not stop.is_set() and self.turns:
            try:
                await asyncio.wait_for(stop.wait(), self.args.kill_every)
                return
            except TimeoutError:
                pass
            name, event = self.turns[turn % len(self.turns)]
            turn += 1
            say(f"chaos: {name}")
            if await event() is not False:
                self.events[name] += 1

    async def kill(self, role: str) -> bool:
        pids = self.cluster.worker_pids(role)
        if pids:
            os.kill(random.choice(pids), signal.SIGKILL)
        return bool(pids)

    async def freeze(self) -> bool:
        pids = [pid for role in self.cluster.roles for pid in self.cluster.worker_pids(role)]
        if not pids:
            return False
        pid = random.choice(pids)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(self.args.freeze_s)
        os.kill(pid, signal.SIGCONT)
        return True

    async def kill_router(self) -> None:
        self.migrations += metric(self.cluster.routers[1], "pdserve_migrations_total")
        await asyncio.to_thread(self.cluster.restart_router)

    async def redis(self) -> None:
        await asyncio.to_thread(self.cluster.restart_redis)


def node_processes() -> list[int]:
    """Worker and engine processes (they carry PDSERVE_NODE, or are pdserve workers)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if "PDSERVE_NODE" in process.environ() or "--settings-json" in process.cmdline():
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=900, help="seconds of chaos")
    parser.add_argument("--kill-every", type=float, default=60, help="seconds between events")
    parser.add_argument("--calm-s", type=float, default=30, help="load before the chaos")
    parser.add_argument("--prefill", type=int, default=2, help="own cluster: prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="own cluster: decode workers")
    parser.add_argument(
        "--flex", type=int, default=0, help="own cluster: this many flex workers instead"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--freeze-s", type=float, default=10)
    parser.add_argument("--request-timeout-s", type=float, default=120)
    parser.add_argument(
        "--events",
        default="",
        help=f"comma-separated, of {','.join(EVENTS)} (default: all the cluster's kind allows)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--serve-args", default=None, help="chaos on `pdserve serve --routers 2` with these"
    )
    where.add_argument("--url", default=None, help="chaos on a running cluster's router(s)")
    parser.add_argument(
        "--cluster", default="pdserve", help="with --url: the cluster's name (its workers')"
    )
    parser.add_argument("--model", default=MODEL, help="with --url: the served model's name")
    args = parser.parse_args()
    return asyncio.run(soak(args))


async def soak(args) -> int:
    folder = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    say(f"logs and state in {folder}")
    shm_before, processes_before = set(SHM.iterdir()), len(node_processes())
    kind = (
        AttachedCluster
        if args.url
        else ServedCluster
        if args.serve_args is not None
        else RayCluster
    )
    cluster = kind(args, folder)
    events = args.events.split(",") if args.events else list(cluster.events)
    if unknown := set(events) - set(cluster.events):
        say(f"{kind.__name__} has no event {sorted(unknown)}: it allows {cluster.events}")
        return 2
    chaos, load = None, None
    try:
        cluster.start()
        chaos = Chaos(args, cluster, events)
        router_a = cluster.routers[0]
        model = args.model if args.url else MODEL
        load = Load(cluster.routers, model, args.request_timeout_s)
        kv_baseline, baseline = kv_blocks_used(router_a), layout(router_a, cluster.flex)
        clients = [asyncio.create_task(load.client(i)) for i in range(args.concurrency)]
        say(f"load: {args.concurrency} clients; {args.calm_s:g} s calm, then chaos {events}")
        await asyncio.sleep(args.calm_s)
        load.phase = "chaos"
        stop_chaos = asyncio.Event()
        running = asyncio.create_task(chaos.run(stop_chaos))
        started = time.monotonic()
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(min(30, args.duration - (time.monotonic() - started)))
            say(f"{time.monotonic() - started:.0f} s: {dict(load.outcomes)} {dict(load.failures)}")
        stop_chaos.set()
        await running
        try:
            healed_s = await wait_healed(router_a, baseline, cluster.flex)
        except TimeoutError as error:
            say(str(error))
            healed_s = float("nan")
        load.stop.set()
        await asyncio.gather(*clients)
        settle = time.monotonic()
        while (kv_now := kv_blocks_used(router_a)) > kv_baseline and time.monotonic() - settle < 30:
            await asyncio.sleep(1)
        migrations = chaos.migrations + sum(
            metric(url, "pdserve_migrations_total") for url in set(cluster.routers)
        )
        failed = sum(load.failures.values())
        ok = failed == 0 and kv_now <= kv_baseline and healed_s == healed_s
    except RuntimeError as error:
        say(str(error))
        return 1
    finally:
        cluster.stop()
    left, shm_left = processes_before, []  # an attached cluster keeps running: its own
    if not args.url:
        deadline = time.monotonic() + 30
        while (left := len(node_processes())) > processes_before and time.monotonic() < deadline:
            time.sleep(0.5)
        shm_left = sorted(p.name for p in set(SHM.iterdir()) - shm_before)
    calm, busy = load.latencies["calm"], load.latencies["chaos"]
    sent, retried = sum(load.outcomes.values()), load.outcomes["retried"]
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
        (
            "whole-response latency p99, calm -> chaos",
            f"{percentile(calm, 99):.2f} s -> {percentile(busy, 99):.2f} s",
        ),
        ("pools back to the layout after", f"{healed_s:.0f} s"),
        ("KV blocks in use, baseline -> end", f"{kv_baseline} -> {kv_now}"),
    ]
    if not args.url:
        rows += [
            ("worker processes, before -> after the stop", f"{processes_before} -> {left}"),
            ("new /dev/shm files after the stop", f"{len(shm_left)} {shm_left or ''}"),
        ]
    for when, what in load.failed_at:
        say(f"failed at {when - started:.1f} s of chaos: {what}")
    print()
    for name, value in rows:
        print(f"{name:45} {value}")
    return 0 if ok and left <= processes_before and not shm_left else 1


if __name__ == "__main__":
    sys.exit(main())
