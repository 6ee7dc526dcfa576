"""KV transport throughput between two processes on this host, against memcpy, and the exposed
transfer per transport through the real cluster.

Part 1 (no engine): the receiver (this process, the decode side's real KvReceiver) and a sender
process (the prefill side's real channel) move, per transport, a 64 MiB slice and one 1536-token
SmolLM2 prompt's KV (30 layer slices of 2.25 MiB in float32), N times each over an open channel
(as between workers that already talk); the clock runs from the sender's start to the last byte
received. memcpy of the same bytes is measured in the same run; the ratio is printed. Each is
measured with KV integrity on (the sender's thread digests every slice, the receiving thread
checks it: kv_transfer/integrity.py) and off (`--integrity on,off`), side by side.

Part 2 (`--cluster`): `pdserve serve` with one prefill worker per transport and one decode
worker, once per `--integrity` setting; fresh 1536-token prompts go round-robin over the prefill
workers, and the router's timing breakdown gives, per transport, the prefill time and the
exposed transfer (what the decode worker waited for KV after the prefill ended), as a share of
the prefill time. Then the idle CPU of every worker (connectors loaded, channels open, no
traffic) over 10 s.

    python scripts/bench_transport.py                 # part 1
    python scripts/bench_transport.py --cluster       # parts 1 and 2 (starts its own cluster)
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kv_transfer.compatibility import Compatibility  # noqa: E402
from kv_transfer.kv_layout import WIRE_LAYOUT  # noqa: E402
from kv_transfer.kv_receiver import KvReceiver  # noqa: E402
from kv_transfer.transport import TRANSPORTS  # noqa: E402

COMPATIBILITY = Compatibility("bench", "float32", 128, 30, 3, 64, WIRE_LAYOUT, "bench", 512, "none")
MIB = 1 << 20
PROMPT_TOKENS = 1536
SMOLLM2_LAYER_BYTES = PROMPT_TOKENS * 3 * 64 * 2 * 4  # tokens x KV heads x head x (K,V) x fp32
PAYLOADS = {
    "64 MiB": [64 * MIB],
    "1536-token prompt": [SMOLLM2_LAYER_BYTES] * 30,
}
WAIT_S = 120.0
IDLE_SETTLE_S = 10.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per transport and payload")
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="which to measure (default: all)"
    )
    parser.add_argument(
        "--integrity", default="on,off", help="KV integrity settings to measure (default: both)"
    )
    parser.add_argument("--cluster", action="store_true", help="also measure through serve")
    parser.add_argument("--cluster-repeats", type=int, default=3, help="prompts per transport")
    parser.add_argument(
        "--sender", nargs=3, metavar=("KIND", "ADDRESS", "INTEGRITY"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.sender:
        return run_sender(*args.sender)
    kinds = args.transports.split(",")
    throughput(kinds, args.repeats, args.integrity.split(","))
    if args.cluster:
        for setting in args.integrity.split(","):
            through_cluster(kinds, args.cluster_repeats, setting)
    return 0


# Part 1 -------------------------------------------------------------------------------------


def run_sender(kind: str, address: str, integrity: str) -> int:
    """The prefill side: on each line "PAYLOAD REPEAT" from stdin, send that payload (each slice
    digested first, as the KV sender's thread does, with integrity on)."""
    from kv_transfer.channels import channel_opener
    from kv_transfer.host_staging import Staged
    from kv_transfer.transport import LayerSlice, sealed

    channel = channel_opener(COMPATIBILITY, "127.0.0.1", torch.device("cpu"))(kind, address)
    sources = {
        n: torch.randint(0, 256, (n,), dtype=torch.uint8) for n in {64 * MIB, SMOLLM2_LAYER_BYTES}
    }
    print("ready", flush=True)
    for line in sys.stdin:
        name, repeat = line.rsplit(" ", 1)
        sizes = PAYLOADS[name]
        for layer, size in enumerate(sizes):
            staged = Staged(sources[size], size)
            piece = LayerSlice(f"{name}-{repeat}", layer, 0, 1, 0, 3, staged, True)
            channel.send(sealed(piece) if integrity == "on" else piece)
        print("sent", flush=True)
    channel.close()
    return 0


def memcpy_seconds(nbytes: int) -> float:
    source = np.random.randint(0, 256, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch both
    started = time.perf_counter()
    np.copyto(target, source)
    return time.perf_counter() - started


def throughput(kinds: list[str], repeats: int, integrity: list[str]) -> None:
    results: dict[tuple[str, str, str], list[float]] = {}
    memcpy: dict[str, list[float]] = {name: [] for name in PAYLOADS}
    for kind in kinds:  # on and off side by side for each transport
        for setting in integrity:
            measure(kind, setting, repeats, results, memcpy)
    print(f"\nKV transport throughput, two processes on this host (median of {repeats}):\n")
    print("| transport | payload | integrity | GB/s | memcpy GB/s | ratio to memcpy |")
    print("|---|---|---|---|---|---|")
    for (kind, name, setting), seconds in results.items():
        nbytes = sum(PAYLOADS[name])
        rate = nbytes / statistics.median(seconds) / 1e9
        copy_rate = nbytes / statistics.median(memcpy[name]) / 1e9
        print(
            f"| {kind} | {name} | {setting} | {rate:.2f} | {copy_rate:.2f} "
            f"| {rate / copy_rate:.0%} |"
        )


def measure(kind: str, integrity: str, repeats: int, results: dict, memcpy: dict) -> None:
    """Time each payload `repeats` times over one channel of `kind`, into `results`."""
    from decode_workers.connector import GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in a decode worker's process
    receiver = KvReceiver(COMPATIBILITY, inbox_bytes=256 * MIB, integrity=integrity == "on")
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    try:
        sender = subprocess.Popen(
            [sys.executable, __file__, "--sender", kind, address, integrity],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            assert sender.stdout.readline().strip() == "ready", f"{kind} sender did not start"
            for name, sizes in PAYLOADS.items():
                for repeat in range(repeats + 1):  # the first warms the channel up
                    started = time.perf_counter()
                    sender.stdin.write(f"{name} {repeat}\n")
                    sender.stdin.flush()
                    receive_all(receiver, sum(sizes), len(sizes))
                    seconds = time.perf_counter() - started
                    assert sender.stdout.readline().strip() == "sent"
                    if repeat:
                        results.setdefault((kind, name, integrity), []).append(seconds)
                        memcpy[name].append(memcpy_seconds(sum(sizes)))
        finally:
            sender.stdin.close()
            sender.wait(timeout=30)
    finally:
        receiver.stop()


def receive_all(receiver: KvReceiver, nbytes: int, slices: int) -> None:
    """Take slices until `slices` have come with `nbytes` in all (releasing each, as the KV
    loader does once it has copied one into the cache)."""
    got = seen = 0
    deadline = time.monotonic() + WAIT_S
    while got < slices:
        complete, cancelled = receiver.take()
        if cancelled:
            raise RuntimeError(f"transfers cancelled: {cancelled}")
        for piece in complete:
            if piece.damage:
                raise RuntimeError(f"a slice failed its integrity check: {piece.damage}")
            seen += len(piece.data)
            piece.release()
        got += len(complete)
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {got} of {slices} slices after {WAIT_S:g} s")
        if not complete:
            time.sleep(0.001)
    assert seen == nbytes, (seen, nbytes)


# Part 2 -------------------------------------------------------------------------------------


def through_cluster(kinds: list[str], repeats: int, integrity: str) -> None:
    import httpx

    from pdserve.bench.local_cluster import local_cluster
    from pdserve.settings.cluster_secret import ensure_cluster_secret
    from pdserve.worker.processes import free_port

    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-transport-"))
    print(
        f"\nstarting pdserve serve ({len(kinds)}P + 1D, one prefill worker per transport, "
        f"KV integrity {integrity}; logs: {log_dir})"
    )
    serve_args = ["--prefill-kv-transports", ",".join(kinds), "--kv-integrity", integrity]
    ensure_cluster_secret()  # serve keeps it: this script then asks the workers directly
    rng = random.Random(0)
    rows: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with local_cluster(len(kinds), 1, free_port(), log_dir, serve_args) as url:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for i in range((repeats + 1) * len(kinds)):  # the first round opens the channels
            prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
            response = httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
                headers={"x-pdserve-route": "disaggregated", "x-pdserve-timing": "1"},
                timeout=300,
            )
            response.raise_for_status()
            timing = response.json()["pdserve_timing"]
            if i >= len(kinds):
                rows[timing["kv_transport"]].append(timing)
        time.sleep(IDLE_SETTLE_S)  # vLLM's engine loops wind down after the last request
        idle = idle_cpu(url)
    print(
        f"\nExposed transfer at {PROMPT_TOKENS} tokens through the cluster, KV integrity "
        f"{integrity} (median of {repeats}):\n"
    )
    print("| transport | prefill s | KV transfer s | exposed s | exposed / prefill |")
    print("|---|---|---|---|---|")
    for kind, timings in rows.items():
        prefill = statistics.median(t["prefill"] for t in timings)
        transfer = statistics.median(t["kv_seconds"] for t in timings)
        exposed = statistics.median(t["exposed_transfer"] for t in timings)
        print(
            f"| {kind} | {prefill:.3f} | {transfer:.3f} | {exposed:.3f} | {exposed / prefill:.1%} |"
        )
    print("\nIdle CPU per worker (connectors loaded, channels open, no traffic, 10 s):\n")
    for name, share in idle.items():
        print(f"- {name}: {share:.2%} of a core")


def idle_cpu(url: str) -> dict[str, float]:
    """CPU time of each worker's process tree over 10 s of no traffic, as a share of a core."""
    import httpx

    workers = httpx.get(f"{url}/pdserve/workers", timeout=10).json()["workers"]
    roots = {
        f"{w['worker_id']} ({worker_transport(w['address'])})": worker_pid(w["address"])
        for w in workers
    }
    before = {name: tree_cpu_seconds(pid) for name, pid in roots.items()}
    time.sleep(10)
    return {name: (tree_cpu_seconds(pid) - before[name]) / 10 for name, pid in roots.items()}


def worker_transport(address: str) -> str:
    """The worker's --kv-transport setting, from its Health."""

    from pdserve.protocol import worker_pb2, worker_pb2_grpc
    from pdserve.settings import tls
    from pdserve.settings.cluster_secret import secret_metadata

    with tls.channel(address) as channel:
        health = worker_pb2_grpc.WorkerStub(channel).Health(
            worker_pb2.HealthRequest(), timeout=5, metadata=secret_metadata()
        )
    return f"kv_transport {health.kv_transport}"


def worker_pid(address: str) -> int:
    """The `pdserve worker` process serving `address` (its settings name the port)."""
    port = address.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if " worker " in command and f'"port":{port},' in command:
            return int(entry.name)
    raise RuntimeError(f"no worker process for {address}")


def tree_cpu_seconds(pid: int) -> float:
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for member in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            children += [int(child) for child in f.read().split()]
    return [child for c in children for child in (c, *descendants(c))]


if __name__ == "__main__":
    sys.exit(main())
