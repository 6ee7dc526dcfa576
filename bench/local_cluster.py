"""A `pdserve serve` cluster as a child process, for the sweep: started in its own process
group, ready once the router answers /health (serve starts the router only after every worker
loaded its model), and always stopped, on every path out, by signalling that group."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

STOP_GRACE_S = 60


class ClusterStartError(RuntimeError):
    pass


@contextmanager
def local_cluster(prefill: int, decode: int, port: int, log_dir: Path, serve_args: list[str],
                  ready_timeout_s: float = 600) -> Iterator[str]:
    """Yields the router's base URL while `pdserve serve --prefill N --decode M` runs; its
    output goes to LOG_DIR/serve.log, its workers' logs next to it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "cluster.cli", "serve", "--prefill", str(prefill), "--decode",
               str(decode), "--port", str(port), "--log-dir", str(log_dir), *serve_args]
    with open(log_dir / "serve.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, ready_timeout_s, log_dir / "serve.log")
        yield url
    finally:
        _stop(process)


def _wait_ready(process: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ClusterStartError(f"pdserve serve exited with {process.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise ClusterStartError(f"pdserve serve not ready after {timeout_s:.0f} s (log: {log})")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the group (serve stops its workers, which also die with it); SIGKILL it if it
    has not exited within the grace period."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
