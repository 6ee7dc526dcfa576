"""Worker processes on this host, for `pdserve serve` and the Ray actors of `pdserve up`:
start one with its settings, wait until its Health says READY, stop it
(pdserve/worker/processes.py)."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings import tls
from pdserve.settings.cluster_secret import secret_metadata
from pdserve.settings.worker import WorkerSettings
from pdserve.worker.fork_server import ForkedProcess, ForkServer
from pdserve.worker.processes import (
    ChildError,
    failure_report,
    free_port,
    spawn,
    stop_group,
    wait_until,
)


@dataclass
class WorkerProcess:
    role: str
    host: str
    port: int
    log_path: Path
    process: subprocess.Popen | ForkedProcess

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def threads_per_worker(workers: int) -> int:
    """Workers on one host split its cores (see start_worker)."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def start_worker(
    settings: WorkerSettings,
    log_dir: Path,
    threads: int,
    env: dict[str, str] | None = None,
    keeper: bool = False,
    fork_server: ForkServer | None = None,
) -> WorkerProcess:
    """Start a worker with `settings` (a free port when its port is 0), whose engine computes
    with `threads` threads: workers sharing a host's cores split them, or their spinning OpenMP
    threads slow each other (and the KV transfer) down. An OMP_NUM_THREADS set by the user wins.
    `keeper`: behind pdserve/cluster/process_keeper (for a parent that may be SIGKILLed with its
    children, as a Ray actor is). The role stays on the command line, for process listings."""
    settings = settings.model_copy(update={"port": settings.port or free_port(settings.host)})
    env = {**os.environ, **(env or {})}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", str(threads))
    log_path = log_dir / f"{settings.role}-{settings.port}.log"
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "worker",
        "--role",
        settings.role,
        "--settings-json",
        settings.model_dump_json(),
    ]
    if keeper:
        command = [sys.executable, "-m", "pdserve.cluster.process_keeper", *command]
    if fork_server is not None:
        if keeper:
            raise ValueError("a worker behind a process keeper is started afresh, not forked")
        process = fork_server.spawn(command, log_path, env)
    else:
        process = spawn(command, log_path, env)
    return WorkerProcess(settings.role, settings.host, settings.port, log_path, process)


def core_shares(tensor_parallel_sizes: list[int], cores: list[int]) -> list[str]:
    """`pdserve serve --cpu-binding split`: each worker's share of `cores`, in order, as vLLM's
    VLLM_CPU_OMP_THREADS_BIND reads it ("0,1", or "0,1|2,3" for a worker of two TP ranks: one
    list per rank). Shares are equal (cores left over go unused); with more ranks than cores,
    ranks share cores in turn."""
    ranks = sum(tensor_parallel_sizes)
    per_rank = max(1, len(cores) // ranks)
    shares, rank = [], 0
    for size in tensor_parallel_sizes:
        lists = []
        for _ in range(size):
            first = (rank * per_rank) % len(cores)
            lists.append(",".join(str(core) for core in cores[first : first + per_rank]))
            rank += 1
        shares.append("|".join(lists))
    return shares


def wait_ready(workers: list[WorkerProcess], timeout_s: float, progress=print) -> None:
    """Until every worker's Health says READY; ChildError with the worker's log tail if one
    exits or fails, or when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    for worker in workers:  # they load side by side: one deadline for all

        def ready(worker=worker) -> bool:
            state, message = _health(worker.address)
            if state == worker_pb2.HealthReply.FAILED:
                raise ChildError(
                    f"worker {worker.role}@{worker.address} failed"
                    + (failure_report(worker.log_path) or f": {message}")
                )
            return state == worker_pb2.HealthReply.READY

        remaining = max(0.0, deadline - time.monotonic())
        wait_until(
            ready,
            worker.process,
            remaining,
            f"worker {worker.role}@{worker.address}",
            worker.log_path,
            progress=lambda elapsed: progress(
                f"waiting for workers to load the model ({elapsed:.0f} s; ~30 s on CPU)"
            ),
        )
        progress(f"worker {worker.role}@{worker.address} ready")


def _health(address: str):
    with tls.channel(address) as channel:
        try:
            reply = worker_pb2_grpc.WorkerStub(channel).Health(
                worker_pb2.HealthRequest(), timeout=2.0, metadata=secret_metadata()
            )
            return reply.state, reply.message
        except grpc.RpcError:
            return None, "not answering yet"


def stop_worker(worker: WorkerProcess, grace_s: float = 20.0) -> None:
    stop_group(worker.process.pid, grace_s, worker.process)


def stop_workers(workers: list[WorkerProcess], grace_s: float = 20.0) -> None:
    """Stop `workers` side by side: each takes a few seconds to shut its engine down, and one
    after another a cluster's stop took the sum."""
    with ThreadPoolExecutor(max(1, len(workers))) as pool:
        list(pool.map(lambda worker: stop_worker(worker, grace_s), workers))
