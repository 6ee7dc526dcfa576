"""Start and stop `pdserve serve` (1P1D) again and again, each stop a different way, and check
that every stop is quick and leaves nothing behind: /dev/shm and the process table as before.

    python scripts/stop_cycles.py [--cycles 5] [--stops sigterm,sigint,group]
        [--serve-args "--kv-cache-gib 0.5"]

The stops: `sigterm` to `serve` (what systemd and a pod's kill send), `sigint` (Ctrl-C), `group`
(SIGTERM to serve's whole process group, as a shell's job control or a supervisor does). Each
cycle serves one request first, so the engines have run. Prints one line per cycle and a table
per stop; exits 1 if a stop took over --max-stop-s or left a file in /dev/shm or a process.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.local_cluster import router_healthy
from pdserve.worker.processes import free_port, spawn, stop_group

SHM = Path("/dev/shm")
STOPS = {
    "sigterm": lambda process: process.send_signal(signal.SIGTERM),
    "sigint": lambda process: process.send_signal(signal.SIGINT),
    "group": lambda process: os.killpg(process.pid, signal.SIGTERM),
}
READY_TIMEOUT_S = 300
SETTLE_S = 10.0  # after serve exits, how long its children get to be gone


def tree(pid: int) -> list[int]:
    try:
        return [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def cycle(stop: str, serve_args: list[str], log_dir: Path) -> dict:
    shm_before = set(SHM.iterdir())
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    process = spawn([*command, "--log-dir", str(log_dir), *serve_args], log_dir / "serve.log")
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        while not router_healthy(url):
            if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"pdserve serve did not start: see {log_dir}/serve.log")
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4},
            timeout=60,
        )
        reply.raise_for_status()
        processes = tree(process.pid)
        asked = time.monotonic()
        STOPS[stop](process)
        process.wait(timeout=120)
        deadline = time.monotonic() + SETTLE_S
        while (alive := [p for p in processes if psutil.pid_exists(p) and _running(p)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        stop_s = time.monotonic() - asked
        left_files = sorted(p.name for p in set(SHM.iterdir()) - shm_before)
        return {
            "ready_s": ready_s,
            "stop_s": stop_s,
            "exit": process.returncode,
            "processes": len(processes),
            "left_processes": alive,
            "left_files": left_files,
        }
    finally:
        stop_group(process.pid, process=process)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--stops", default=",".join(STOPS))
    parser.add_argument("--serve-args", default="--kv-cache-gib 0.5")
    parser.add_argument("--max-stop-s", type=float, default=5.0, help="idle stop bound")
    args = parser.parse_args()
    stops = args.stops.split(",")
    if not set(stops) <= set(STOPS):
        parser.error(f"--stops: choose from {', '.join(STOPS)}")
    failed = False
    summary = []
    for stop in stops:
        results = []
        for number in range(1, args.cycles + 1):
            with tempfile.TemporaryDirectory(prefix="pdserve-cycles-") as folder:
                result = cycle(stop, args.serve_args.split(), Path(folder))
            results.append(result)
            print(
                f"{stop} {number}/{args.cycles}: ready {result['ready_s']:.1f} s, stopped in "
                f"{result['stop_s']:.2f} s (exit {result['exit']}, {result['processes']} "
                f"processes), left: {len(result['left_processes'])} processes, "
                f"{len(result['left_files'])} /dev/shm files {result['left_files'] or ''}",
                flush=True,
            )
            failed |= bool(result["left_processes"] or result["left_files"])
            failed |= result["stop_s"] > args.max_stop_s
        stop_times = [r["stop_s"] for r in results]
        summary.append(
            (
                stop,
                statistics.median(stop_times),
                max(stop_times),
                sum(len(r["left_processes"]) for r in results),
                sum(len(r["left_files"]) for r in results),
            )
        )
    print(
        f"\n{'stop':8} {'median s':>9} {'max s':>7} {'processes left':>15} {'shm files left':>15}"
    )
    for stop, median, worst, processes, files in summary:
        print(f"{stop:8} {median:9.2f} {worst:7.2f} {processes:15d} {files:15d}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
