"""Start, wait for, and stop worker processes on this host.

Each worker runs in its own process group, so stopping it also stops vLLM's engine-core
children; the group is killed by its id, never by name. A worker also gets SIGTERM if its
launcher dies (Linux parent-death signal), so no engine outlives `pdserve serve`.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.protocol import worker_pb2, worker_pb2_grpc

PR_SET_PDEATHSIG = 1


@dataclass
class WorkerProcess:
    role: str
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_worker(role: str, engine_argv: list[str], log_dir: Path, threads: int,
                 host: str = "127.0.0.1", port: int | None = None,
                 env: dict[str, str] | None = None, keeper: bool = False) -> WorkerProcess:
    """Start a worker whose engine computes with `threads` threads: workers sharing a host's
    cores split them, or their spinning OpenMP threads slow each other (and the KV transfer)
    down. An OMP_NUM_THREADS set by the user wins. `keeper`: behind cluster/process_keeper (for
    a parent that may be SIGKILLed with its children, as a Ray actor is)."""
    port = port or free_port(host)
    env = {**os.environ, **(env or {})}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", str(threads))
    log_path = log_dir / f"{role}-{port}.log"
    command = [sys.executable, "-m", "cluster.cli", "worker", "--role", role,
               "--host", host, "--port", str(port), *engine_argv]
    if keeper:
        command = [sys.executable, "-m", "cluster.process_keeper", *command]
    return WorkerProcess(role, host, port, log_path, spawn_child(command, log_path, env))


def spawn_child(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """A child in its own process group that gets SIGTERM when its parent dies."""
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=die_with_parent, env=env)


def wait_ready(workers: list[WorkerProcess], timeout_s: float, progress=print) -> None:
    """Block until every worker's Health says READY; raise RuntimeError with the worker's log
    tail if one exits or fails, or when the deadline passes."""
    started = time.monotonic()
    pending = list(workers)
    last_report = started
    while pending:
        for worker in list(pending):
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.address} exited with code "
                                   f"{worker.process.returncode}:\n{worker.log_tail()}")
            state, message = _health(worker.address)
            if state == worker_pb2.HealthReply.READY:
                pending.remove(worker)
                progress(f"worker {worker.role}@{worker.address} ready after "
                         f"{time.monotonic() - started:.0f} s")
            elif state == worker_pb2.HealthReply.FAILED:
                raise RuntimeError(f"worker {worker.address} failed: {message}\n"
                                   f"{worker.log_tail()}")
        elapsed = time.monotonic() - started
        if pending and elapsed > timeout_s:
            raise RuntimeError(f"workers not ready after {timeout_s:.0f} s: "
                               + ", ".join(w.address for w in pending))
        if pending and time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            progress(f"waiting for {len(pending)} worker(s) to load the model "
                     f"({elapsed:.0f} s; ~30 s on CPU)")
        if pending:
            time.sleep(0.5)


def _health(address: str):
    with grpc.insecure_channel(address) as channel:
        try:
            reply = worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(),
                                                               timeout=2.0)
            return reply.state, reply.message
        except grpc.RpcError:
            return None, "not answering yet"


def stop_worker(worker: WorkerProcess, grace_s: float = 20.0) -> None:
    stop_child(worker.process, grace_s)


def stop_child(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the child's process group, then SIGKILL whatever is left after the grace."""
    group = process.pid  # start_new_session made the child its group's leader
    _signal_group(group, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(group, signal.SIGKILL)
    process.wait(timeout=5)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass
