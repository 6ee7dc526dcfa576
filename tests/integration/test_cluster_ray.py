"""`pdserve up/status/scale/down` on a real Ray cluster with 4 fake GPUs and a real Redis
server, both started here; real vLLM workers (the tiny random-weight Llama on CPU: Ray, the
launcher and the keeper are under test here, and its requests leave the cores to the engines
that start under the stream) and the real router.

Ray runs its token auth, as under `pdserve up` (review C1): the head started here keeps its token
in a 0600 file, which every `pdserve` command and this process use, and a process without it
cannot join the cluster; no actor's entry in Ray's actor table holds the cluster secret.

One cluster for the module: 1P2D up; 1P1D -> 2P1D -> 1P2D under a steady stream of requests
(each role's pool shrinks and grows); chaos under a mixed load on two routers (a killed worker
actor and a killed worker process, both replaced by the replica keeper; a frozen worker; a
killed router; a Redis restart), losing no request; down. Each test first scales the cluster to
the layout it starts from (a no-op in file order), so each passes alone and in any order.
"""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from openai import OpenAI

from pdserve.bench.chaos_load import Load
from pdserve.cluster import local_services, ray_launcher
from pdserve.model_store.store import ensure_model
from pdserve.protocol.registry import read_members
from pdserve.worker.processes import free_port, spawn, stop_group
from tests.integration.helpers import scrape
from tests.integration.http_client import HTTP
from tests.integration.processes import (
    alive,
    children,
    command_line,
    descendants,
    group_members,
    pids_running,
    pids_with_environment,
)
from tests.integration.prompts import TINY_MAX_TOKENS as MAX_TOKENS
from tests.integration.prompts import TINY_PROMPTS as PROMPTS
from tests.waiting import wait_for

CLUSTER = "pdtest"
MODEL = "tiny"
KV_CACHE_GIB = 0.25
KV_POOL_GIB = 0.125
HEARTBEAT_S = 1.0
ORPHAN_TIMEOUT_S = 10.0  # a SIGKILLed worker's engine processes are gone by then
STOP_TIMEOUT_S = 30.0  # a worker whose actor was killed stops gracefully (SIGTERM) by then
REPLACE_TIMEOUT_S = 300.0  # a replacement is placed in ~1 s; its engine loads in ~30-90 s here
COMMAND_TIMEOUT_S = 600
STRANGER_TIMEOUT_S = 120  # a refused ray.init returns in a few seconds
PAUSE_S = 0.5  # between a stream thread's requests
# Between a chaos client's requests: requests stay in flight on every worker, and the load
# leaves the cores to the replacements' engines (back to back, the load took ~100 s of CPU).
CHAOS_PAUSE_S = 0.1


def pdserve(
    *args: str, env: dict, timeout: float = COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def ray_and_redis(tmp_path_factory):
    """A Ray head with 4 fake GPUs (token auth, as `pdserve up` starts it: this process is its
    driver, and the processes it starts inherit the token's path) and a Redis server, stopped by
    process group at the end. Yields Ray's address and the Redis server's {url, port, group,
    log} (a test that restarts Redis puts its new group there)."""
    logs = tmp_path_factory.mktemp("ray-redis")
    redis_url, redis_group = local_services.start_redis(logs / "redis.log")
    redis = {
        "url": redis_url,
        "port": int(redis_url.rsplit(":", 1)[1].split("/")[0]),
        "group": redis_group,
        "log": logs / "redis.log",
    }
    try:
        address, ray_group = local_services.start_ray_head(8, 4, logs / "ray.log")
    except BaseException:
        stop_group(redis_group)
        raise
    yield address, redis
    local_services.stop_ray_head(ray_group)
    stop_group(redis["group"])
    leftovers = [pid for group in (ray_group, redis["group"]) for pid in group_members(group)]
    assert not leftovers, f"processes left after stopping Ray and Redis: {leftovers}"
    deadline = time.monotonic() + 30  # workers and their engine processes carry PDSERVE_NODE
    while (left := pids_with_environment("PDSERVE_NODE")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"worker or engine processes outlived the cluster: {left}"


@pytest.fixture(scope="module")
def cluster(ray_and_redis, tmp_path_factory):
    address, redis = ray_and_redis
    ensure_model(MODEL)
    folder = tmp_path_factory.mktemp("cluster")
    config = folder / "cluster.yaml"
    config.write_text(
        CLUSTER_FILE.format(
            name=CLUSTER,
            model=MODEL,
            port=free_port(),
            redis=redis["url"],
            heartbeat=HEARTBEAT_S,
            kv_cache_gib=KV_CACHE_GIB,
            kv_pool_gib=KV_POOL_GIB,
        )
    )
    env = {**os.environ, "PDSERVE_STATE_DIR": str(folder / "state")}  # with the Ray token's path
    assert env["RAY_AUTH_MODE"] == "token" and Path(env["RAY_AUTH_TOKEN_PATH"]).is_file()
    started = time.monotonic()
    up = pdserve("up", "-f", str(config), "--address", address, env=env)
    up_seconds = time.monotonic() - started
    state_file = folder / "state" / f"{CLUSTER}.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    info = {"config": config, "env": env, "state": state}
    ray_launcher.connect(address, CLUSTER, env["RAY_AUTH_TOKEN_PATH"])
    try:
        assert up.returncode == 0, up.stderr[-6000:]
        print(f"pdserve up (1P2D) took {up_seconds:.1f} s")
        yield info
    finally:
        worker_pids = [
            pid
            for pid in pids_running("worker", "--settings-json")
            if f'"cluster":"{CLUSTER}"' in " ".join(command_line(pid))
        ]
        pool_pids = [
            pid
            for pid in pids_running("kv_transfer.pool.store")
            if any(word.startswith(f"@pdserve-kv-pool-{CLUSTER}-") for word in command_line(pid))
        ]
        down = pdserve("down", "-f", str(config), env=env)
        try:
            assert down.returncode == 0, down.stderr[-4000:]
            assert ray.util.list_named_actors() == [], "actors left after pdserve down"
            assert not [
                g
                for g in ray.util.placement_group_table().values()
                if g["name"].startswith(f"pdserve-{CLUSTER}-") and g["state"] != "REMOVED"
            ], "placement groups left after pdserve down"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(map(alive, worker_pids + pool_pids)):
                time.sleep(0.2)
            assert not [pid for pid in worker_pids if alive(pid)], "workers outlived pdserve down"
            assert not [pid for pid in pool_pids if alive(pid)], "KV pool outlived pdserve down"
        finally:
            ray.shutdown()


# route_policy length: every prompt of the stream (over 4 tokens) has a prefill worker compute
# it, so both pools serve it (the estimate could keep short prompts on the decode workers).
CLUSTER_FILE = """
name: {name}
model: {{path: {model}, dtype: float32}}
engine: {{kv_cache_gib: {kv_cache_gib}}}
prefill: {{replicas: 1, tensor_parallel_size: 1, gpu_type: H100-SXM}}
decode: {{replicas: 2, tensor_parallel_size: 1, gpu_type: H100-SXM}}
transport: {{kind: grpc, kv_timeout_s: 30}}
kv_pool: {{gib: {kv_pool_gib}}}
router: {{port: {port}, route_policy: length, disaggregate_min_tokens: 4}}
registry: {{url: "{redis}", heartbeat_s: {heartbeat}}}
"""


def _status(cluster) -> dict:
    done = pdserve("status", "-f", str(cluster["config"]), "--json", env=cluster["env"], timeout=60)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _client(cluster) -> OpenAI:
    return OpenAI(
        base_url=f"{cluster['state']['router_url']}/v1",
        api_key="unused",
        timeout=120,
        max_retries=0,
    )


def _layout(cluster, prefill: int, decode: int) -> list[dict]:
    """The status' workers, once the cluster runs `prefill` and `decode` workers (scaled there
    when a test before left another layout)."""
    workers = _status(cluster)["workers"]
    roles = [w["role"] for w in workers if w["state"] == "in pool"]
    if (roles.count("prefill"), roles.count("decode")) == (prefill, decode):
        return workers
    _scale(cluster, prefill, decode)
    return _status(cluster)["workers"]


def test_up_gives_each_worker_its_own_placement_group_and_gpu(cluster, tiny_reference):
    workers = _layout(cluster, 1, 2)  # as the cluster file has it
    names = sorted(w["worker"] for w in workers)
    groups = [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(f"pdserve-{CLUSTER}-") and g["state"] == "CREATED"
    ]
    assert sorted(g["name"] for g in groups) == [f"pdserve-{CLUSTER}-{name}" for name in names]
    for group in groups:
        assert group["strategy"] == "STRICT_PACK"
        assert list(group["bundles"].values()) == [{"GPU": 1.0}]

    assert all(w["state"] == "in pool" for w in workers)
    gpu_ids = [tuple(w["gpu_ids"]) for w in workers]
    assert all(len(ids) == 1 for ids in gpu_ids), gpu_ids
    assert len(set(gpu_ids)) == len(workers), f"two workers share a GPU: {gpu_ids}"
    for worker in workers:  # the worker process itself was given exactly that GPU
        environment = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={worker['gpu_ids'][0]}".encode() in environment

    health = HTTP.get(f"{cluster['state']['router_url']}/health", timeout=10).json()
    assert sorted(health["workers"]) == names
    reply = _client(cluster).completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].text == tiny_reference["prompts"][0]["text"]


STRANGER = """
import sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
except Exception as error:
    print("refused:", type(error).__name__, str(error)[:200])
else:
    print("JOINED", ray.cluster_resources())
"""


@pytest.mark.parametrize("mode", ["disabled", "token"])
def test_a_process_without_the_ray_token_cannot_join_the_cluster(cluster, tmp_path, mode):
    """After `pdserve up`: a fresh process that has no token (none in its environment, no
    ~/.ray/auth_token), with auth off or on its side, is refused by the GCS."""
    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    # Ray's driver retries the GCS once a second, 20 times by default: 3 tries say the same
    # (a refused join) without waiting 20 s for it
    env.update(RAY_AUTH_MODE=mode, HOME=str(tmp_path), RAY_NUM_REDIS_GET_RETRIES="3")
    done = subprocess.run(
        [sys.executable, "-c", STRANGER, address],
        env=env,
        text=True,
        capture_output=True,
        timeout=STRANGER_TIMEOUT_S,
    )
    assert "refused:" in done.stdout and "JOINED" not in done.stdout, done.stdout + done.stderr


def test_no_actor_holds_a_secret_in_the_actor_table(cluster):
    """Ray's actor table (what its state API shows any GCS client) holds each actor's options,
    runtime_env included: the cluster secret reaches the actors' processes another way."""
    from ray._private.state import state

    secret = cluster["state"]["cluster_secret"].encode()
    assert len(secret) >= 16  # the one tests/integration/conftest.py gives every test
    table = state._connect_and_get_accessor().get_actor_table(None, None)
    assert len(table) >= 3  # the workers, the router, the keeper
    assert not [entry for entry in table if secret in entry]


def test_the_node_has_one_kv_pool_that_its_workers_fill(cluster):
    """`up` started one store on the node (an actor beside the workers) for the prefill and
    decode workers. A prompt the prefill worker computes leaves its blocks there, and `status`
    shows them."""
    workers = _layout(cluster, 1, 2)
    (pool,) = _status(cluster)["kv_pools"]
    assert pool["budget_bytes"] == int(KV_POOL_GIB * 2**30)
    assert pool["exit_code"] is None and pool["stats"] is not None, pool
    assert f"--address {pool['address']}" in " ".join(command_line(pool["pid"]))
    for worker in workers:
        settings = json.loads(_settings_json(worker["pid"]))
        assert settings["kv_pool_address"] == pool["address"], (worker["worker"], settings)
    before = pool["stats"]["used"]
    _client(cluster).completions.create(
        model=MODEL, prompt=" ".join(PROMPTS) * 4, max_tokens=2, temperature=0
    )  # its prompt is several blocks long, and prefilled on the prefill worker
    wait_for(
        lambda: _status(cluster)["kv_pools"][0]["stats"]["used"] > before,
        timeout_s=30,
        what="the prefill worker's blocks in the node's KV pool",
        poll_s=1,
    )


def _settings_json(pid: int) -> str:
    line = command_line(pid)
    return line[line.index("--settings-json") + 1]


class SteadyStream:
    """Requests one after another (`threads` at a time, each thread pausing `pause_s` between
    two) until stopped; each answer is checked against vLLM's offline output, and when it ended
    and which workers served it are kept. The pause leaves the host's two cores to the engines
    that start meanwhile (back-to-back requests took one of them); with none, requests are in
    flight on every worker at once."""

    def __init__(self, cluster, reference: dict, threads: int = 2, pause_s: float = PAUSE_S):
        self.client = _client(cluster)
        self.pause_s = pause_s
        self.reference = reference
        self.sent = 0
        self.failures: list[str] = []
        self.served: list[tuple[float, set[str]]] = []  # (when it ended, its workers)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i, threads)) for i in range(threads)
        ]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a request hung"

    def served_by_each(self, workers: set[str], since: float) -> bool:
        """Whether every one of `workers` served a request that ended after `since`."""
        return workers <= {w for ended, names in self.served if ended > since for w in names}

    def _run(self, offset: int, step: int) -> None:
        i = offset
        while not self.stop.is_set():
            index = i % len(PROMPTS)
            self.sent += 1
            try:
                raw = self.client.completions.with_raw_response.create(
                    model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0
                )
                reply = raw.parse()
                expected = self.reference["prompts"][index]["text"]
                if reply.choices[0].text != expected:
                    self.failures.append(
                        f"prompt {index}: {reply.choices[0].text!r} != {expected!r}"
                    )
                names = {
                    raw.headers.get(h) for h in ("x-pdserve-worker", "x-pdserve-prefill-worker")
                }
                self.served.append((time.monotonic(), names - {None}))
            except Exception as error:
                self.failures.append(f"prompt {index}: {type(error).__name__}: {error}")
            i += step
            self.stop.wait(self.pause_s)


def _scale(cluster, prefill: int, decode: int) -> float:
    started = time.monotonic()
    done = pdserve(
        "scale",
        "-f",
        str(cluster["config"]),
        "--prefill",
        str(prefill),
        "--decode",
        str(decode),
        env=cluster["env"],
    )
    assert done.returncode == 0, done.stderr[-6000:]
    seconds = time.monotonic() - started
    roles = [w["role"] for w in _status(cluster)["workers"] if w["state"] == "in pool"]
    assert (roles.count("prefill"), roles.count("decode")) == (prefill, decode)
    return seconds


def test_ratio_changes_under_a_steady_stream_fail_no_request(cluster, tiny_reference):
    timings = {}
    with SteadyStream(cluster, tiny_reference) as stream:
        for prefill, decode in ((1, 1), (2, 1), (1, 2)):
            timings[f"{prefill}P{decode}D"] = _scale(cluster, prefill, decode)
        final, scaled = _in_pools(cluster), time.monotonic()
        wait_for(lambda: stream.served_by_each(final, scaled), 120, f"requests on each of {final}")
    print(
        f"scale timings (s): {timings}; requests sent {stream.sent}, failed {len(stream.failures)}"
    )
    assert stream.sent >= 30
    assert stream.failures == []


def _group_id(worker: str) -> str:
    (group,) = [
        g["placement_group_id"]
        for g in ray.util.placement_group_table().values()
        if g["name"] == f"pdserve-{CLUSTER}-{worker}" and g["state"] == "CREATED"
    ]
    return group


def _running_everywhere(cluster, workers: set[str]) -> bool:
    """Whether the router's view of the workers' Stats shows a request in each of `workers`."""
    rows = HTTP.get(f"{cluster['state']['router_url']}/pdserve/workers", timeout=10).json()
    running = {row["worker_id"] for row in rows["workers"] if row.get("running_requests", 0) > 0}
    return workers <= running


def _in_pools(cluster) -> set[str]:
    return set(HTTP.get(f"{cluster['state']['router_url']}/health", timeout=5).json()["workers"])


def _kv_blocks_used(cluster) -> int:
    rows = HTTP.get(
        f"{cluster['state']['router_url']}/pdserve/workers", params={"fresh": True}, timeout=30
    ).json()["workers"]
    return sum(row.get("kv_blocks_used", 0) for row in rows)


def _cluster_worker_processes() -> list[int]:
    return [
        pid
        for pid in pids_running("worker", "--settings-json")
        if f'"cluster":"{CLUSTER}"' in " ".join(command_line(pid))
        and "pdserve.cluster.process_keeper" not in command_line(pid)
    ]


class ChaosLoad:
    """chaos_load's clients (whole, streamed, n=2 and aborted requests, each retried once at
    the other router when its own died) on an event loop of their own thread, until the block
    ends."""

    def __init__(self, routers: list[str], clients: int = 4):
        self.load = Load(routers, MODEL, timeout_s=120, pause_s=CHAOS_PAUSE_S)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._run(clients),)
        )

    async def _run(self, clients: int) -> None:
        await asyncio.gather(*(self.load.client(i) for i in range(clients)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self.load

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.load.stop.set)
        self.thread.join(timeout=180)
        assert not self.thread.is_alive(), "a request hung"
        self.loop.close()

    def served_since(self, count: int) -> bool:
        return sum(self.load.outcomes.values()) >= count


@contextlib.contextmanager
def second_router(redis_url: str, folder: Path):
    """`pdserve router` over the cluster's registry (a second front door); yields a function
    that SIGKILLs it and starts it again on its port, and its URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "pdserve.cli", "router", "--registry", redis_url,
        "--cluster", CLUSTER, "--port", str(port), "--model", MODEL,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    processes = []

    def start() -> None:
        processes.append(spawn(command, folder / f"router-{len(processes)}.log"))
        wait_for(lambda: _pools_at(url) == (1, 2), 120, "router b serving 1P2D")

    def restart() -> None:
        os.killpg(processes[-1].pid, signal.SIGKILL)
        processes[-1].wait(timeout=10)
        start()

    start()
    try:
        yield restart, url
    finally:
        stop_group(processes[-1].pid, process=processes[-1])


def _pools_at(url: str) -> tuple[int, int] | None:
    """The router at `url`'s (prefill, decode) pool sizes; None while it does not answer."""
    try:
        pools = HTTP.get(f"{url}/health", timeout=5).json()["pools"]
    except Exception:
        return None
    return pools["prefill"], pools["decode"]


def _timeline(events: dict[str, float], failures: list[tuple[float, str]]) -> str:
    """The events and the failed requests in the order they happened, each at its time after
    the first event: which event a failure followed."""
    start = min(events.values())
    rows = sorted([*((t, f"event: {name}") for name, t in events.items()), *failures])
    return "\n".join(f"{t - start:8.2f} s  {what}" for t, what in rows)


def test_chaos_under_a_mixed_load_fails_no_request_and_every_baseline_comes_back(
    cluster, ray_and_redis, tmp_path
):
    """Two routers over the registry (`pdserve up`'s and a `pdserve router`) under chaos_load's
    mixed load; each event once, each when the state it needs is observed: a decode worker's
    actor killed (ray.kill) and the prefill worker's process SIGKILLed while every worker has a
    request in flight; the other decode worker frozen (SIGSTOP) until it leaves the pools, then
    thawed; the second router SIGKILLed and started again; Redis restarted on its port. No
    request fails. The killed workers leave the pools within two heartbeats, none of their
    processes outlives them, and the replica keeper replaces each (new placement groups,
    counted); the frozen one comes back and is not replaced; the pools, the KV blocks in use and
    the worker processes come back to what they were."""
    _, redis = ray_and_redis
    rows = {row["worker"]: row for row in _layout(cluster, 1, 2)}
    keeper_before = _status(cluster)["keeper"]
    metrics_before = scrape(keeper_before["metrics_url"])
    (process_victim,) = [name for name, row in rows.items() if row["role"] == "prefill"]
    actor_victim = max(name for name, row in rows.items() if row["role"] == "decode")
    frozen = min(name for name, row in rows.items() if row["role"] == "decode")
    old_processes = {  # the process keeper, the worker, its engine processes
        name: [rows[name]["pid"], *descendants(rows[name]["pid"])]
        for name in (actor_victim, process_victim)
    }
    assert all(len(pids) >= 3 for pids in old_processes.values()), old_processes
    (worker_process,) = children(rows[process_victim]["pid"])
    (frozen_process,) = children(rows[frozen]["pid"])
    assert os.getpgid(worker_process) == worker_process
    old_groups = {name: _group_id(name) for name in (actor_victim, process_victim)}
    kv_before, processes_before = _kv_blocks_used(cluster), len(_cluster_worker_processes())
    events, at = {}, {}  # what took how long; when each event began (time.monotonic())
    with second_router(redis["url"], tmp_path) as (restart_router, router_b):
        chaos = ChaosLoad([cluster["state"]["router_url"], router_b])
        with chaos as load:
            # kill -9 a worker process and ray.kill a worker actor, with requests on each
            wait_for(
                lambda: _running_everywhere(cluster, set(rows)), 60, "requests on every worker"
            )
            ray.kill(ray.get_actor(actor_victim), no_restart=True)
            os.kill(worker_process, signal.SIGKILL)
            killed = at["workers killed"] = time.monotonic()
            while _in_pools(cluster) & {actor_victim, process_victim}:
                assert time.monotonic() - killed < 2 * HEARTBEAT_S + 0.5, (
                    f"still in the router's pools {time.monotonic() - killed:.1f} s after the kill"
                )
                time.sleep(0.05)
            events["killed workers out of the pools after (s)"] = round(
                time.monotonic() - killed, 2
            )
            for name, timeout_s in (
                (process_victim, ORPHAN_TIMEOUT_S),
                (actor_victim, STOP_TIMEOUT_S),
            ):
                wait_for(
                    lambda name=name: not [p for p in old_processes[name] if alive(p)],
                    max(0.1, timeout_s - (time.monotonic() - killed)),
                    f"{name}'s processes gone",
                )
            wait_for(
                lambda: {actor_victim, process_victim} <= _in_pools(cluster),
                REPLACE_TIMEOUT_S,
                "the killed workers replaced",
                poll_s=0.5,
            )
            events["replaced after (s)"] = round(time.monotonic() - killed, 1)
            # SIGSTOP: out of the pools while frozen, back once thawed, not replaced
            os.kill(frozen_process, signal.SIGSTOP)
            frozen_at = at["worker frozen"] = time.monotonic()
            try:
                wait_for(lambda: frozen not in _in_pools(cluster), 30, "the frozen worker out")
            finally:
                os.kill(frozen_process, signal.SIGCONT)
            events["frozen worker out of the pools after (s)"] = round(
                time.monotonic() - frozen_at, 2
            )
            at["worker thawed"] = time.monotonic()
            wait_for(lambda: frozen in _in_pools(cluster), 60, "the thawed worker back")
            # kill -9 the second router: its clients' requests retry at the first
            sent = sum(load.outcomes.values())
            restarted = at["router b killed"] = time.monotonic()
            restart_router()
            at["router b serving"] = time.monotonic()
            events["router b serving again after (s)"] = round(time.monotonic() - restarted, 1)
            # Redis restarts on its port: both routers serve on, the workers register again
            restarted = at["Redis stopped"] = time.monotonic()
            stop_group(redis["group"])
            _, redis["group"] = local_services.start_redis(redis["log"], port=redis["port"])
            # (the routers keep their pools a few seconds after a restart: the records count)
            wait_for(
                lambda: (
                    len(read_members(redis["url"], CLUSTER)) == 3
                    and all(
                        _pools_at(url) == (1, 2)
                        for url in (cluster["state"]["router_url"], router_b)
                    )
                ),
                60,
                "every worker registered again and both routers' pools back after Redis restarted",
            )
            events["pools back after Redis restarted (s)"] = round(time.monotonic() - restarted, 1)
            wait_for(lambda: chaos.served_since(sent + 12), 120, "requests after the last event")
    print(f"chaos: {events}; outcomes {dict(load.outcomes)}, failures {dict(load.failures)}")
    assert dict(load.failures) == {}, _timeline(at, load.failed_at)
    assert load.outcomes["deadline passed"] == 0
    assert load.outcomes["retried"] + load.outcomes["succeeded"] >= 20
    wait_for(lambda: _kv_blocks_used(cluster) == kv_before, 30, "KV blocks back to the baseline")
    assert len(_cluster_worker_processes()) == processes_before
    status = _status(cluster)
    assert sorted(w["worker"] for w in status["workers"] if w["state"] == "in pool") == sorted(rows)
    keeper = status["keeper"]
    for role in ("prefill", "decode"):  # the frozen worker was not replaced
        replaced_before = keeper_before["replacements"].get(role, 0)
        assert keeper["replacements"][role] == replaced_before + 1, keeper
        failed_before = keeper_before["failed_starts"].get(role, 0)
        assert keeper["failed_starts"].get(role, 0) == failed_before, keeper
    metrics = scrape(keeper["metrics_url"])
    for role in ("prefill", "decode"):
        series = f'pdserve_worker_replacements_total{{role="{role}"}}'
        assert metrics.get(series, 0.0) == metrics_before.get(series, 0.0) + 1, metrics
    for name, group in old_groups.items():  # a new placement group; the old one removed
        assert _group_id(name) != group
        assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
