"""Shared fixtures: one real `pdserve serve` (router + a prefill and a decode vLLM worker on
CPU) for the session, and vLLM's offline engine's greedy output as the reference.

A vLLM engine takes ~30 s of both cores to start and ~2.5 GB, so the tests share clusters: a
session's cluster stops right after the last test that uses it (not at the session's end), so
its memory goes back to the modules after it. Teardown checks that SIGTERM stopped the router and
every process it started.

The tier runs as two streams side by side (`pytest -n 2`, scripts/test.sh): a stream is one
pytest-xdist process (tests/xdist_groups.py) running its modules in the order of `STREAMS`, so one
stream's engines start while the other's tests wait on theirs. The streams together keep at
most eight SmolLM2 engines alive (the host's 24 GiB hold about nine), and a session cluster
belongs to one stream only. Without xdist the same order runs in one process.
"""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pdserve.bench import local_cluster
from pdserve.bench.local_cluster import router_healthy
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.worker.processes import ChildError, free_port, spawn, stop_group, wait_until
from tests.integration.http_client import HTTP
from tests.integration.processes import alive, descendants, rpc_folders_named_in, worker_pids
from tests.integration.prompts import (
    DISAGGREGATED_PROMPTS,
    PROMPTS,
    SAMPLING_CASES,
    TINY_MAX_TOKENS,
)
from tests.integration.references import References, made_for, run_folder
from tests.integration.trace_collector import TraceCollector
from tests.kv_faults import injectable_environment
from tests.xdist_groups import ModuleGroups

SERVED_MODEL = "smollm2"
START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
# Per worker: 11.6K SmolLM2 tokens (the 8,192 of one longest request, and the tests' few
# concurrent ones); vLLM zeroes it at start, ~1 s of a core per GiB.
KV_CACHE_GIB = "0.5"


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_dir: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def workers(self, fresh: bool = False) -> list[dict]:
        return HTTP.get(f"{self.url}/pdserve/workers", params={"fresh": fresh}, timeout=30).json()[
            "workers"
        ]

    def worker(self, role: str, fresh: bool = False) -> dict:
        (row,) = [w for w in self.workers(fresh) if w["role"] == role]
        return row

    def log(self) -> str:
        return "\n".join(
            path.read_text(errors="replace")[-4000:] for path in sorted(self.log_dir.glob("*.log"))
        )


# The two streams, each a list of modules in the order they run, of about equal length. Stream a
# holds the largest cluster (the mixed pool: 5 SmolLM2 engines, ~12 GB), the KV pool's two, then
# the tiny models' (Ray's, ~6 GB with its head; the flex sweep's; the MoE models', one cluster at
# a time, ~5 GB of PSS), then the README's two engines. Stream b holds at most three
# SmolLM2 engines at a time (~7 GB): the default cluster (stopped after its last user) beside
# vLLM's own server, the tiny MLA models' clusters, the flex cluster, then the tiny model at TP 2
# (~9 GB), then starts that fail (the tiny model's). (A third stream, tried: the host's cores
# were then the limit, and the third default cluster it needed cost more than it saved.)
STREAMS = {
    "a": [
        "test_kv_transports",
        "test_migration",
        "test_kv_failures",
        "test_kv_pool",
        "test_cluster_ray",
        "test_flex_sweep",
        "test_moe",
        "test_gpu_check",
        "test_readme",  # last: it takes the README's port and two engines of 2 GiB KV each
    ],
    "b": [
        "test_api_keys",
        "test_bench_real_router",
        "test_disaggregation",
        "test_fuzz",
        "test_http_errors",
        "test_admission_control",  # not first: the other stream's engines then start
        "test_openai_api",
        "test_streaming_load",
        "test_tracing",
        "test_vllm_parity",
        "test_worker_observability",
        "test_mla",  # here, not in a: a ran ~90 s longer than b with it
        "test_flex_roles",
        "test_tensor_parallel",
        "test_failed_start",  # here, not in a: a ran ~65 s longer than b with it (559 / 493 s)
    ],
}
_PLACES = {
    module: (stream, position)
    for stream, modules in STREAMS.items()
    for position, module in enumerate(modules)
}


def pytest_xdist_make_scheduler(config, log):
    return ModuleGroups(config, log, lambda module: _PLACES[module][0])


def pytest_collection_modifyitems(config, items):
    """Integration tests run in their streams' order, after any other tier's tests."""
    ours = [item for item in items if item.module.__name__.startswith(f"{__package__}.")]
    unplaced = {item.module.__name__ for item in ours} - {
        f"{__package__}.{module}" for module in _PLACES
    }
    if unplaced:
        raise pytest.UsageError(f"add {sorted(unplaced)} to STREAMS in {__file__}")
    placed = set(ours)
    others = [item for item in items if item not in placed]
    items[:] = others + sorted(ours, key=_place)  # stable: a module's tests keep their order


def _place(item: pytest.Item) -> tuple[str, int]:
    return _PLACES[item.module.__name__.rpartition(".")[2]]


SHM = Path("/dev/shm")
SHM_SETTLE_S = 15.0  # how long the last cluster's processes get to exit and clean up


def _runs_the_session(config) -> bool:
    """This process is the run itself, not one of its xdist streams."""
    return not hasattr(config, "workerinput")


_SHM_BEFORE = pytest.StashKey[set]()


def pytest_configure(config):
    if _runs_the_session(config):
        config.stash[_SHM_BEFORE] = set(SHM.iterdir())


def pytest_sessionfinish(session, exitstatus):
    """The suite leaves /dev/shm as it found it: every engine's message queues, communicator
    files and semaphores are gone once the last cluster of both streams has stopped (checked
    where the run started, once every stream has ended)."""
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return
    deadline = time.monotonic() + SHM_SETTLE_S
    while (left := set(SHM.iterdir()) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    sizes = {path.name: path.stat().st_size for path in left if path.exists()}
    if sizes:
        session.config.get_terminal_writer().line(
            f"FAILED: the test suite left files in /dev/shm (name: bytes): {sizes}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def one_cluster_secret():
    """Every cluster the tests start inherits this secret (`serve` keeps one it is given), so
    a test can call a worker directly, and a second router can front a server's workers."""
    os.environ[SECRET_ENV] = secrets.token_urlsafe(16)
    yield
    del os.environ[SECRET_ENV]


def start_server(log_dir: Path, *args: str, env: dict[str, str] | None = None) -> Server:
    """`pdserve serve ARGS`, its environment this one's with `env` added. In float32 unless
    ARGS name a dtype: the answers must equal vLLM's offline engine's, which in bfloat16 depend
    on what else shares a batch (one of twelve SmolLM2 answers differed, batched or alone)."""
    port = free_port()
    process = spawn(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--port",
            str(port),
            "--kv-cache-gib",
            KV_CACHE_GIB,
            "--dtype",
            "float32",
            "--log-dir",
            str(log_dir),
            *args,
        ],
        log_dir / "serve.log",
        env={**os.environ, **(env or {})},
    )
    server = Server(f"http://127.0.0.1:{port}", process, log_dir)
    try:
        wait_until(
            lambda: router_healthy(server.url),
            process,
            START_TIMEOUT_S,
            "pdserve serve",
            poll_s=1.0,
        )
    except ChildError as error:
        _stop_and_check(server)
        pytest.fail(f"{error}\n{server.log()}")
    except BaseException:
        _stop_and_check(server)
        raise
    return server


_LAST_USERS: dict[str, pytest.Item] = {}  # session cluster fixture -> the last test using it
_EARLY_STOPS: dict[str, Callable[[], None]] = {}  # the same -> how it stops, while it runs


def pytest_collection_finish(session):
    for item in session.items:
        for name in item.fixturenames:
            _LAST_USERS[name] = item


@contextlib.contextmanager
def stopped_after_last_use(name: str, stop: Callable[[], None]):
    """Calls `stop` (of the session fixture `name`'s clusters) once the last test that uses it
    has finished, or at the session's end, whichever comes first."""
    _EARLY_STOPS[name] = stop
    try:
        yield
    finally:
        if stop := _EARLY_STOPS.pop(name, None):
            stop()


@pytest.fixture(autouse=True)
def _session_clusters_stop_after_their_last_test(request):
    yield
    for name in [n for n, item in _LAST_USERS.items() if item is request.node]:
        if stop := _EARLY_STOPS.pop(name, None):
            stop()


@pytest.fixture(scope="session")
def trace_collector():
    """An OTLP collector the default cluster exports its traces to."""
    collector = TraceCollector()
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory, trace_collector) -> Server:
    """The default cluster: 1 prefill + 1 decode worker, exporting traces to `trace_collector`
    (stopped with it: its gRPC server's polling costs a few percent of a core)."""
    cluster = start_server(
        tmp_path_factory.mktemp("serve-logs"), "--otlp-endpoint", trace_collector.endpoint
    )

    def stop() -> None:
        _stop_and_check(cluster)
        trace_collector.stop()

    with stopped_after_last_use("server", stop):
        yield cluster


FORCED_TRANSPORTS = ("grpc", "nccl", "shm")


@pytest.fixture(scope="session")
def mixed_pool(smollm2_dir, tmp_path_factory):
    """`mixed_pool(prefill, decode)`: three prefill workers forced onto grpc, nccl (gloo on CPU)
    and shm, two decode workers on auto (policy recompute), round-robin, with at least `prefill`
    and `decode` of them alive (started again when a test before killed more, so each test
    passes alone and in any order), taking KV faults from tests/kv_faults.set_fault(its
    log_dir, ...). The transport tests and the kill tests share it."""
    servers = []

    def with_alive(prefill: int = len(FORCED_TRANSPORTS), decode: int = 2) -> Server:
        if servers and (
            len(worker_pids(servers[-1], "prefill")) < prefill
            or len(worker_pids(servers[-1], "decode")) < decode
        ):
            _stop_and_check(servers.pop())
        if not servers:
            log_dir = tmp_path_factory.mktemp("mixed-pool")
            servers.append(
                start_server(
                    log_dir,
                    "--prefill",
                    str(len(FORCED_TRANSPORTS)),
                    "--prefill-kv-transports",
                    ",".join(FORCED_TRANSPORTS),
                    "--decode",
                    "2",
                    "--policy",
                    "round-robin",
                    "--kv-timeout",
                    "30",
                    env=injectable_environment(log_dir),
                )
            )
        return servers[-1]

    def stop_all():
        while servers:
            _stop_and_check(servers.pop())

    with stopped_after_last_use("mixed_pool", stop_all):
        yield with_alive


@pytest.fixture(scope="module")
def vllm_server(smollm2_dir, tmp_path_factory) -> str:
    """vLLM's own OpenAI server (`vllm serve`) on the same model and engine settings as the
    workers: the reference the router's answers must equal. Yields its URL; stopped after the
    module that uses it (one engine fewer for the rest of the session)."""
    with local_cluster.vllm_server(
        smollm2_dir,
        tmp_path_factory.mktemp("vllm-serve"),
        START_TIMEOUT_S,
        SERVED_MODEL,
        int(float(KV_CACHE_GIB) * (1 << 30)),
        free_port(),
        dtype="float32",  # as start_server's clusters
    ) as url:
        yield url


@pytest.fixture(scope="session", autouse=True)
def references(request, tmp_path_factory) -> Iterator[References]:
    """vLLM's offline answers the run's tests ask for, made from the run's start
    (tests/integration/references.py)."""
    with made_for(request.session.items, run_folder(tmp_path_factory)) as made:
        yield made


@pytest.fixture(scope="session")
def offline_reference(references) -> dict:
    """Greedy outputs of vLLM's offline engine for tests/prompts.py."""
    (outputs,) = references.answers("offline_reference")
    count, sampling = len(PROMPTS), len(SAMPLING_CASES)
    disaggregated = count + sampling + len(DISAGGREGATED_PROMPTS)
    return {
        "prompts": outputs["prompts"][:count],
        "sampling": outputs["prompts"][count : count + sampling],
        "chats": outputs["chats"],
        "disaggregated": outputs["prompts"][count + sampling : disaggregated],
        "pool": outputs["prompts"][disaggregated:],  # POOL_TURNS, then POOL_FAULT_PROMPT
        "conversations": outputs["conversations"],  # DECODE_POOL_CONVERSATIONS
    }


def tiny_completion(url: str, prompt: str, route: str, model: str = "tiny") -> httpx.Response:
    """A greedy completion from a tiny model (served under its name) on `route` of the router at
    `url`, with the timing breakdown."""
    return HTTP.post(
        f"{url}/v1/completions",
        timeout=120,
        headers={"x-pdserve-route": route, "x-pdserve-timing": "1"},
        json={"model": model, "prompt": prompt, "max_tokens": TINY_MAX_TOKENS, "temperature": 0},
    )


@pytest.fixture(scope="session")
def tiny_reference(references) -> dict:
    """Greedy outputs of vLLM's offline engine at TP=1 for the tiny model's prompts."""
    (outputs,) = references.answers("tiny_reference")
    return outputs


def _stop_and_check(server: Server) -> None:
    """SIGTERM the router; it must exit and leave no child behind (checked by process group:
    the workers run in their own groups, found through their parent link), nor a worker's
    folder of vLLM's IPC sockets (pdserve/worker/rpc_folder.py)."""
    children = descendants(server.process.pid)
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        for pid in children:
            _kill(pid)
        pytest.fail(f"pdserve serve did not stop within {STOP_TIMEOUT_S} s of SIGTERM")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.2)
    left = [pid for pid in children if alive(pid)]
    for pid in left:
        _kill(pid)
    assert not left, f"processes left after pdserve serve stopped: {left}"
    folders = rpc_folders_named_in(server.log_dir)
    assert folders, f"no worker logged its IPC socket folder in {server.log_dir}"
    kept = sorted(str(folder) for folder in folders if folder.exists())
    assert not kept, f"IPC socket folders left after pdserve serve stopped: {kept}"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def router_in_front_of(server: Server, folder: Path, **settings):
    """A second router (`pdserve router`) over `server`'s workers, with `settings`; yields its
    URL."""
    with router_over([w["address"] for w in server.workers()], folder, **settings) as url:
        yield url


@contextlib.contextmanager
def router_over(addresses: list[str], folder: Path, **settings):
    """A router (`pdserve router`) over the workers at `addresses` (of one cluster or several:
    they share the session's secret), with `settings` (SmolLM2 unless they name a model);
    yields its URL, and stops it by process group."""
    port = free_port()
    document = {
        "port": port,
        "model": "smollm2",
        "served_model_name": SERVED_MODEL,
        "worker_addresses": addresses,
        **settings,
    }
    log = folder / "router.log"
    process = spawn(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "router",
            "--settings-json",
            json.dumps(document),
        ],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: router_healthy(url), process, 120, "pdserve router", log)
        yield url
    finally:
        stop_group(process.pid, process=process)
