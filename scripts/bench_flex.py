"""What a flex worker costs against fixed-role ones, and how long a role change takes under load.

    python scripts/bench_flex.py [--idle-s 20] [--changes 6] [--serve-args "--model tiny"]

Starts `pdserve serve` 1P1D (fixed roles), measures each worker's memory (its process tree's
resident set) and CPU while idle, stops it; then the same for `pdserve serve --flex 2`, and on
that cluster times role changes (`POST /pdserve/roles`, 1P1D <-> 0P2D) while requests stream
through it. Prints one table. Takes a few minutes (two cluster starts).
"""

import argparse
import asyncio
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.local_cluster import local_cluster
from pdserve.bench.runner import run_jobs
from pdserve.worker.processes import free_port

MODEL = "smollm2"  # the name the clusters serve


def worker_trees() -> dict[str, list[psutil.Process]]:
    """Each worker started under this process: its `pdserve worker` process and descendants."""
    trees = {}
    for process in psutil.Process().children(recursive=True):
        command = " ".join(process.cmdline())
        if "pdserve.cli worker" in command:
            role = command.split("--role ")[1].split()[0]
            trees[f"{role}-{process.pid}"] = [process, *process.children(recursive=True)]
    return trees


def idle_cost(idle_s: float) -> dict[str, tuple[float, float]]:
    """Per worker: (resident MiB, CPU % of one core) over `idle_s` seconds with no request."""
    trees = worker_trees()
    before = {
        name: sum(p.cpu_times().user + p.cpu_times().system for p in t) for name, t in trees.items()
    }
    time.sleep(idle_s)
    cost = {}
    for name, tree in trees.items():
        used = sum(p.cpu_times().user + p.cpu_times().system for p in tree) - before[name]
        cost[name] = (sum(p.memory_info().rss for p in tree) / 2**20, 100 * used / idle_s)
    return cost


async def role_changes(url: str, changes: int) -> list[float]:
    """Seconds per POST /pdserve/roles while 2 clients keep requests in flight."""
    body = {"model": MODEL, "prompt": "Once upon a time " * 40, "max_tokens": 16, "temperature": 0}
    failed = 0

    async def request(_: int) -> None:
        nonlocal failed
        try:
            reply = await http.post(f"{url}/v1/completions", json=body)
            failed += reply.status_code != 200
        except httpx.HTTPError:  # a dropped connection or a timeout is a failed request too
            failed += 1

    async with httpx.AsyncClient(timeout=120) as http:
        load = asyncio.create_task(run_jobs(request, concurrency=2))
        took = []
        try:
            for change in range(changes):
                await asyncio.sleep(1.0)
                started = time.monotonic()
                reply = await http.post(f"{url}/pdserve/roles", json={"prefill": (change + 1) % 2})
                took.append(time.monotonic() - started)
                assert reply.status_code == 200, reply.text
        finally:  # the requests still in flight are left out
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
    print(f"requests failed during the role changes: {failed}", file=sys.stderr)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--changes", type=int, default=6)
    parser.add_argument("--serve-args", default="--kv-cache-gib 1")
    args = parser.parse_args()
    serve_args = [*shlex.split(args.serve_args), "--served-model-name", MODEL]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-flex-") as folder:
        for label, flex in (("fixed 1P1D", 0), ("flex x2", 2)):
            print(f"{label}: starting", file=sys.stderr)
            log_dir = Path(folder) / label.replace(" ", "-")
            with local_cluster(1, 1, free_port(), log_dir, serve_args, flex=flex) as url:
                time.sleep(5)  # the router's first polls settle
                for name, (mib, cpu) in sorted(idle_cost(args.idle_s).items()):
                    rows.append(f"{label:<12}{name:<22}{mib:>10.0f}{cpu:>10.1f}")
                if flex:
                    took = asyncio.run(role_changes(url, args.changes))
    print(f"{'cluster':<12}{'worker':<22}{'RSS MiB':>10}{'idle CPU%':>10}")
    print("\n".join(rows))
    print(
        f"role change under load: median {statistics.median(took) * 1e3:.0f} ms, "
        f"max {max(took) * 1e3:.0f} ms over {len(took)} changes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
