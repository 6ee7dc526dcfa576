"""A `pdserve serve` cluster as a child process, for the sweep: started in its own process
group, ready once the router answers /health (serve starts the router only after every worker
loaded its model), and always stopped, on every path out (worker/processes.py)."""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from worker.processes import ChildError, spawn, stop_group, wait_until

STOP_GRACE_S = 60


class ClusterStartError(RuntimeError):
    pass


@contextmanager
def local_cluster(
    prefill: int,
    decode: int,
    port: int,
    log_dir: Path,
    serve_args: list[str],
    ready_timeout_s: float = 600,
    flex: int = 0,
) -> Iterator[str]:
    """Yields the router's base URL while `pdserve serve --prefill N --decode M` (or, with
    `flex`, `--flex N`) runs; its output goes to LOG_DIR/serve.log, its workers' logs next to
    it."""
    workers = (
        ["--flex", str(flex)] if flex else ["--prefill", str(prefill), "--decode", str(decode)]
    )
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        *workers,
        "--port",
        str(port),
        "--log-dir",
        str(log_dir),
        *serve_args,
    ]
    process = spawn(command, log_dir / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: router_healthy(url),
            process,
            ready_timeout_s,
            "pdserve serve",
            log_dir / "serve.log",
            poll_s=1.0,
        )
        yield url
    except ChildError as error:
        raise ClusterStartError(str(error)) from None
    finally:
        stop_group(process.pid, STOP_GRACE_S, process)


def router_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
