"""A `pdserve serve` cluster (or plain vLLM, the reference) as a child process, for the
sweep, the comparison scripts and the tests: started in its own process group, ready once it
answers /health (serve starts the router only after every worker loaded its model), and always
stopped, on every path out (pdserve/worker/processes.py)."""

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdserve.worker.engine_dtype import AUTO, engine_dtype
from pdserve.worker.processes import ChildError, spawn, stop_group, wait_until

STOP_GRACE_S = 60
WORKER_METRICS_URL = re.compile(r"metrics on (http://\S+/metrics)")  # pdserve/worker/metrics_server


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
        "pdserve.cli",
        "serve",
        *workers,
        "--port",
        str(port),
        "--log-dir",
        str(log_dir),
        *serve_args,
    ]
    with served(command, log_dir / "serve.log", port, "pdserve serve", ready_timeout_s) as url:
        yield url


@contextmanager
def vllm_server(
    model_dir: Path,
    log_dir: Path,
    ready_timeout_s: float,
    served_model: str,
    kv_cache_bytes: int,
    port: int,
    name: str = "vllm",
    more_args: tuple[str, ...] = (),
    more_env: dict[str, str] | None = None,
    defaults: bool = False,
    dtype: str = AUTO,
) -> Iterator[str]:
    """Plain vLLM (`vllm serve`: its OpenAI server) with a pdserve worker's engine settings and
    threads (`dtype` as a worker resolves it on this CPU): the reference pdserve is compared
    with. Yields its URL; logs to LOG_DIR/NAME.log.
    `more_args` and `more_env` add to (or override) its options and environment: vLLM's own P/D
    in scripts/compare_vllm.py is two such servers with a KV connector, a core each. With
    `defaults`, vLLM as its users start it instead: the model, its name and the address, every
    engine setting and thread binding vLLM's own (its dtype, torch.compile, its KV cache size,
    a core kept for its front end)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_model,
        "--enable-prompt-tokens-details",  # cached tokens in usage, as pdserve's router reports
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(log_dir / f"{name}-cache"),
        "VLLM_RPC_BASE_PATH": str(log_dir / f"{name}-rpc"),
    }
    if not defaults:
        command += ["--dtype", engine_dtype(dtype, cpu=True), "--enforce-eager", "--seed", "0"]
        command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        env |= {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # The model in the engine-core process, as a pdserve worker at TP 1 runs it
            # (pdserve/worker/engine.py: model_in_the_engine_core).
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    command += more_args
    env |= more_env or {}
    for folder in ("VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH"):  # vLLM makes neither itself
        Path(env[folder]).mkdir(parents=True, exist_ok=True)
    log_path, what = log_dir / f"{name}.log", f"vLLM's api_server ({name})"
    with served(command, log_path, port, what, ready_timeout_s, env) as url:
        yield url


@contextmanager
def served(
    command: list[str],
    log_path: Path,
    port: int,
    what: str,
    ready_timeout_s: float,
    env: dict | None = None,
    cwd: Path | None = None,
) -> Iterator[str]:
    """Yields the server's URL once its /health answers 200, while `command` runs in its own
    process group (in `cwd`); stopped on every path out."""
    process = spawn(command, log_path, env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: router_healthy(url), process, ready_timeout_s, what, log_path, poll_s=1.0
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


def worker_metrics_urls(log_dir: Path) -> list[str]:
    """Each worker's /metrics, from the line it logs at start in its log under `log_dir`
    (`pdserve serve --log-dir`; a restarted worker's last line)."""
    urls = []
    for log in sorted(log_dir.glob("*.log")):
        urls += WORKER_METRICS_URL.findall(log.read_text(errors="replace"))[-1:]
    return urls
