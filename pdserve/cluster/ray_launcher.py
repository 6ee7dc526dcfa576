"""Workers and the router as Ray actors: one detached placement group and one detached, named
actor per worker, all in the namespace `pdserve-<cluster>`, so that later commands (`down`,
`scale`, `status`) find exactly what `up` created.

Each actor (`ProcessHost`) starts its process (`pdserve worker`, or `pdserve router`) and owns it:
the process gets SIGTERM when the actor dies (parent-death signal), so killing the actor kills
the worker, and the worker's registry entry then expires. Ray sets CUDA_VISIBLE_DEVICES in an
actor that holds GPUs, and the worker inherits it: each worker sees only its own GPU ids.
`start_worker` is also how the replica keeper (pdserve/cluster/replica_keeper.py) replaces a dead
worker.

Secrets never travel in an actor's options: Ray shows every actor's `runtime_env` to whoever asks
its state API. `up` puts the cluster secret and the Redis password in Ray's internal key-value
store, under the cluster's namespace (`publish_member_secrets`), and each actor's process reads
them from there before its actor starts (`receive_member_secrets`, Ray's worker process set-up
hook): in its environment, its worker or router inherits them. Who can read that store can run
code on every node anyway: Ray's token (pdserve/cluster/local_services.py) guards both.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray._private import ray_constants
from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as SETUP_HOOK_ENV
from ray._raylet import AuthenticationTokenLoader, Config
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from kv_transfer.pool.wire import PoolStats
from pdserve.cluster.local_services import RAY_TOKEN_ENV, use_ray_auth
from pdserve.cluster.placement import WorkerSlot
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.redis_url import PASSWORD_ENV
from pdserve.settings.router import RouterSettings
from pdserve.settings.tls import TLS_DIR_ENV
from pdserve.settings.worker import WorkerSettings
from pdserve.worker.engine import PLACEMENT_GROUP_ENV, RAY_NAMESPACE_ENV

ROUTER = "router"
KV_POOL_PREFIX = "kv-pool-"  # a node's KV pool store's actor: kv-pool-<node id>-<group>
PLACEMENT_TIMEOUT_S = 30.0
ACTOR_CALL_TIMEOUT_S = 60.0
MEMBER_SECRETS = (SECRET_ENV, PASSWORD_ENV)  # what each actor gets, never through its options
MEMBER_SECRETS_KEY = "pdserve-member-secrets"  # in Ray's internal KV, the cluster's namespace
MEMBER_NAMESPACE_ENV = "PDSERVE_RAY_NAMESPACE_OF_SECRETS"  # where an actor's hook finds them


def namespace(cluster: str) -> str:
    return f"pdserve-{cluster}"


def connect(address: str, cluster: str, token_path: str | None = "") -> None:
    """Join the Ray cluster at `address` as a driver in the cluster's namespace, with Ray's token
    auth: the token in the file `token_path` (the head `up` started), or with "" the caller's own
    Ray token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); None only for a head
    started with `--ray-auth off`. RuntimeError saying so when it cannot be reached."""
    if ray.is_initialized():
        return
    use_ray_auth(token_path)
    # Ray read RAY_AUTH_MODE, its token and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it was
    # imported: read them again (as its own `ray start` does after enabling token auth).
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray_constants.ENABLE_RAY_CLUSTER = token_path is not None  # False: 127.0.0.1 stays itself
    try:
        ray.init(
            address=address,
            namespace=namespace(cluster),
            log_to_driver=False,
            logging_level="WARNING",
            configure_logging=True,
        )
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RuntimeError(f"cannot connect to Ray at {address}: {error}") from None


def check_loopback_nodes() -> None:
    """RuntimeError unless every node of the connected cluster is at 127.0.0.1 (where Ray then
    binds its ports: a cluster without auth must be this host's alone)."""
    elsewhere = [
        node["NodeManagerAddress"]
        for node in ray.nodes()
        if node["Alive"] and node["NodeManagerAddress"] != "127.0.0.1"
    ]
    if elsewhere:
        raise RuntimeError(
            "refusing to run Ray without auth: its node(s) listen at "
            f"{', '.join(elsewhere)}, not only at 127.0.0.1 (drop --ray-auth off)"
        )


def publish_member_secrets() -> None:
    """Put this process's cluster secret and Redis password where the cluster's actors read
    them (Ray's internal KV, the driver's namespace): `up` does, before its first actor."""
    from ray.experimental.internal_kv import _internal_kv_put

    values = {name: os.environ[name] for name in MEMBER_SECRETS if os.environ.get(name)}
    _internal_kv_put(
        MEMBER_SECRETS_KEY, json.dumps(values), overwrite=True, namespace=_secrets_namespace()
    )


def forget_member_secrets() -> None:
    """Remove what `publish_member_secrets` put in Ray (`down`)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(MEMBER_SECRETS_KEY, namespace=_secrets_namespace())


def receive_member_secrets() -> None:
    """Ray's worker process set-up hook of every pdserve actor (see `member_env`): the cluster's
    secrets into this process's environment, before its actor starts. A cluster whose secrets
    were never published fails the actor's start rather than run a worker without its secret
    (an open worker)."""
    from ray.experimental.internal_kv import _internal_kv_get

    where = os.environ[MEMBER_NAMESPACE_ENV]
    value = _internal_kv_get(MEMBER_SECRETS_KEY, namespace=where)
    if value is None:
        raise RuntimeError(f"no member secrets in Ray's namespace {where}: `pdserve up` puts them")
    try:
        secrets = json.loads(value)
    except ValueError:
        secrets = None
    if (
        type(secrets) is not dict
        or not secrets.keys() <= set(MEMBER_SECRETS)
        or not all(type(secret) is str for secret in secrets.values())
    ):
        raise RuntimeError(f"the member secrets in Ray's namespace {where} are not what up puts")
    os.environ.update(secrets)


def member_env() -> dict:
    """Ray options giving an actor this cluster's cluster secret and Redis password (the
    keeper's replacements get what `up`'s workers got) without holding either: its process's
    set-up hook fetches them (`receive_member_secrets`). The actor checks its worker's health
    with them, and the worker it starts inherits them. The TLS folder (a path) is given as it
    is. Never on a command line, never in the actor table."""
    env_vars = {
        SETUP_HOOK_ENV: f"{__name__}.{receive_member_secrets.__name__}",
        MEMBER_NAMESPACE_ENV: _secrets_namespace(),
    }
    if os.environ.get(TLS_DIR_ENV):
        env_vars[TLS_DIR_ENV] = os.environ[TLS_DIR_ENV]
    return {"runtime_env": {"env_vars": env_vars}}


def _secrets_namespace() -> str:
    """The cluster's namespace: an actor's own (its hook was told), or the driver's."""
    return os.environ.get(MEMBER_NAMESPACE_ENV) or ray.get_runtime_context().namespace


@dataclass(frozen=True)
class HostedProcess:
    """What a ProcessHost says of its process (a worker, the router or a node's KV pool store),
    returned to `up`, `scale`, `status` and the replica keeper through Ray's calls."""

    pid: int
    node: str  # the Ray node id it runs on
    log: str  # its log file
    address: str = ""  # a worker's gRPC host:port; a KV pool store's socket address
    url: str = ""  # the router's http://host:port
    gpu_ids: tuple[str, ...] = ()  # the accelerator ids a worker may see
    budget_bytes: int = 0  # a KV pool store's
    exit_code: int | None = None  # None: it was running when described


def node_resources() -> list[dict[str, float]]:
    """What each alive node has in all (for a plan) or free now (for scale-up)."""
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


@ray.remote(num_cpus=0, max_restarts=0)
class ProcessHost:
    """Holds one process for its whole life; see the module docstring."""

    def __init__(self) -> None:
        self.process = None
        self.info: HostedProcess | None = None

    def start_worker(
        self,
        settings_json: str,
        log_dir: str,
        threads: int,
        env: dict[str, str],
        loopback: bool,
        kv_pool_bytes: int,
    ) -> HostedProcess:
        from pdserve.cluster.local_workers import start_worker

        node = ray.get_runtime_context().get_node_id()
        host = "127.0.0.1" if loopback else _node_address(node)
        settings = WorkerSettings.model_validate_json(settings_json)
        if settings.wants_kv_pool and kv_pool_bytes:
            address = node_kv_pool(
                settings.cluster, node, settings.kv_pool_group, log_dir, kv_pool_bytes
            )
            settings = settings.model_copy(update={"kv_pool_address": address})
        worker = start_worker(
            settings.model_copy(update={"host": host, "port": 0}),
            Path(log_dir),
            threads,
            env={"PDSERVE_NODE": node, **env},
            keeper=True,
        )
        self.process = worker.process
        self.info = HostedProcess(
            pid=worker.process.pid,
            node=node,
            log=str(worker.log_path),
            address=worker.address,
            gpu_ids=tuple(str(g) for g in ray.get_gpu_ids()),
        )
        return self.info

    def start_router(self, settings_json: str, log_dir: str) -> HostedProcess:
        from pdserve.worker.processes import free_port, spawn

        settings = RouterSettings.model_validate_json(settings_json)
        host, port = settings.host, settings.port or free_port(settings.host)
        log_path = Path(log_dir) / f"router-{port}.log"
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "router",
            "--settings-json",
            settings.model_copy(update={"port": port}).model_dump_json(),
        ]
        # The router faces clients and needs no Ray: it does not get Ray's token.
        env = {name: value for name, value in os.environ.items() if name not in RAY_TOKEN_ENV}
        self.process = spawn(
            [sys.executable, "-m", "pdserve.cluster.process_keeper", *command], log_path, env
        )
        reachable = (
            _node_address(ray.get_runtime_context().get_node_id())
            if host in ("0.0.0.0", "::")
            else host
        )
        self.info = HostedProcess(
            pid=self.process.pid,
            node=ray.get_runtime_context().get_node_id(),
            log=str(log_path),
            url=f"http://{reachable}:{port}",
        )
        return self.info

    def start_kv_pool(self, log_dir: str, budget_bytes: int, address: str) -> HostedProcess:
        """This node's KV pool store, started once: a second worker on the node gets the
        running one (a store that exited is started again at the same address)."""
        from pdserve.cluster.local_services import start_kv_pool

        if self.process is None or self.process.poll() is not None:
            log_path = Path(log_dir) / f"{address.lstrip('@')}.log"
            _, self.process = start_kv_pool(log_path, budget_bytes, address)
            self.info = HostedProcess(
                pid=self.process.pid,
                node=ray.get_runtime_context().get_node_id(),
                log=str(log_path),
                address=address,
                budget_bytes=budget_bytes,
            )
        return self.info

    def kv_pool_stats(self) -> PoolStats | None:
        """The store's own figures (kv_transfer/pool/store.py), for `status`; None while it
        does not answer."""
        from kv_transfer.pool.client import store_stats

        return store_stats(self._started().address)

    def describe(self) -> HostedProcess:
        return replace(self._started(), exit_code=self.process.poll())

    def log_tail(self) -> str:
        from pdserve.worker.processes import log_tail

        return log_tail(Path(self.info.log)) if self.info is not None else " (no log)"

    def _started(self) -> HostedProcess:
        """What this actor started; RuntimeError (to the caller, through Ray) before that."""
        if self.info is None:
            raise RuntimeError("no process started (yet)")
        return self.info

    def stop(self, grace_s: float = 20.0) -> None:
        from pdserve.worker.processes import stop_group

        if self.process is not None:
            stop_group(self.process.pid, grace_s, self.process)


def _node_address(node_id: str) -> str:
    """The address Ray knows this node by (127.0.0.1 for the local head `up` starts)."""
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)


def start_worker(
    cluster: str,
    slot: WorkerSlot,
    settings: WorkerSettings,
    log_dir: str,
    threads: int,
    loopback: bool,
    kv_pool_bytes: int,
) -> HostedProcess:
    """Reserve the worker's placement group, start its actor inside it, start the process;
    returns what the actor says of it.
    `loopback`: the cluster is this one host, and workers listen on 127.0.0.1 only (Ray itself
    refuses a loopback node address); otherwise on their node's address. `kv_pool_bytes`: the
    budget of the node's KV pool, started there for the first worker that uses it (0: none).
    The actor holds the worker's GPUs (Ray sets CUDA_VISIBLE_DEVICES for it) when its vLLM runs
    them itself: at TP 1, and a data-parallel worker's ranks; a TP group of one rank runs
    vLLM's Ray executor in the placement group instead. A group's node > 0 joins the host of
    its node 0 (`slot.leader`, started before it)."""
    group = placement_group(
        list(slot.bundles),
        strategy="STRICT_PACK",
        name=_group_name(cluster, slot.name),
        lifetime="detached",
    )
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"{slot.name}: Ray could not place {list(slot.bundles)} on one node "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s"
        ) from None
    data_parallel = settings.engine.data_parallel_size > 1
    gpus = slot.device == "GPU"
    holds = gpus and (data_parallel or slot.tensor_parallel_size == 1)
    host = ProcessHost.options(
        name=slot.name,
        lifetime="detached",
        **member_env(),
        **({"num_gpus": slot.devices} if holds else {}),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        ),
    ).remote()
    env = {}
    if gpus and not holds:
        # The worker's vLLM runs its Ray executor in this group (pdserve/worker/engine.py).
        env = {
            PLACEMENT_GROUP_ENV: _group_name(cluster, slot.name),
            RAY_NAMESPACE_ENV: namespace(cluster),
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        }
    settings = settings.model_copy(update={"worker_id": slot.name})
    if slot.group_node:
        settings = settings.model_copy(update={"engine": group_member(settings, slot)})
    return ray.get(
        host.start_worker.remote(
            settings.model_dump_json(), log_dir, threads, env, loopback, kv_pool_bytes
        ),
        timeout=ACTOR_CALL_TIMEOUT_S,
    )


def group_member(settings: WorkerSettings, slot: WorkerSlot):
    """The engine settings of node `slot.group_node` of a data-parallel group: its ranks, and
    the host of the group's node 0, which it joins."""
    leader = describe(slot.leader).address.rsplit(":", 1)[0]
    return settings.engine.model_copy(
        update={"data_parallel_node": slot.group_node, "data_parallel_address": leader}
    )


def node_kv_pool(cluster: str, node: str, group: str, log_dir: str, budget_bytes: int) -> str:
    """The address of node `node`'s KV pool store (kv_transfer/pool/store.py) for its workers
    of `group` (WorkerSettings.kv_pool_group: their tensor-parallel size), held by a named
    actor pinned to that node (`kv-pool-<node>-<group>`) and started by the first worker there
    that asks; `pdserve down` stops it with the other actors."""
    host = ProcessHost.options(
        name=kv_pool_actor(node, group),
        get_if_exists=True,
        lifetime="detached",
        **member_env(),
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote()
    address = f"@pdserve-kv-pool-{cluster}-{node[:12]}-{group}"
    info = ray.get(
        host.start_kv_pool.remote(log_dir, budget_bytes, address), timeout=ACTOR_CALL_TIMEOUT_S
    )
    return info.address


def kv_pool_stats(name: str) -> PoolStats | None:
    """The figures of the store a node's KV pool actor holds; None while it does not answer."""
    try:
        return ray.get(actor(name).kv_pool_stats.remote(), timeout=10)
    except (ValueError, ray.exceptions.RayError):
        return None


def kv_pool_actor(node: str, group: str) -> str:
    return f"{KV_POOL_PREFIX}{node[:12]}-{group}"


def is_kv_pool(name: str) -> bool:
    return name.startswith(KV_POOL_PREFIX)


def start_router(settings: RouterSettings, log_dir: str) -> HostedProcess:
    """The router runs on this node (the one `pdserve up` runs on), so its URL is reachable."""
    host = ProcessHost.options(
        name=ROUTER,
        lifetime="detached",
        **member_env(),
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote()
    return ray.get(
        host.start_router.remote(settings.model_dump_json(), log_dir), timeout=ACTOR_CALL_TIMEOUT_S
    )


def actor_names(cluster: str) -> list[str]:
    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == namespace(cluster)
    )


def actor(name: str):
    return ray.get_actor(name)


def describe(name: str) -> HostedProcess:
    """What the actor `name` says of its process; RuntimeError saying why when it cannot
    (gone, not answering within 10 s, or it started none)."""
    try:
        return ray.get(actor(name).describe.remote(), timeout=10)
    except (ValueError, ray.exceptions.RayError) as error:
        raise RuntimeError(f"{name}: {type(error).__name__}: {error}") from None


def stop_actors(cluster: str, names: list[str], grace_s: float = 20.0) -> None:
    """Stop the actors' processes (all at once), kill the actors, free their placement groups."""
    hosts = {}
    for name in names:
        try:
            hosts[name] = actor(name)
        except ValueError:
            pass
    stopping = {name: host.stop.remote(grace_s) for name, host in hosts.items()}
    for name, reply in stopping.items():
        try:
            ray.get(reply, timeout=grace_s + 10)
        except ray.exceptions.RayError:
            pass  # already dead: its process got the parent-death signal
        ray.kill(hosts[name], no_restart=True)
    for name in names:
        try:
            remove_placement_group(get_placement_group(_group_name(cluster, name)))
        except ValueError:
            pass  # the router, or a worker whose group is already gone


def remove_orphan_groups(cluster: str) -> list[str]:
    """Placement groups of this cluster whose actor is gone (killed, or crashed): freed, so the
    GPUs return and the name can be used again. Returns their names."""
    live = {_group_name(cluster, name) for name in actor_names(cluster)}
    orphans = [
        group["name"]
        for group in ray.util.placement_group_table().values()
        if group["name"].startswith(f"{namespace(cluster)}-")
        and group["state"] != "REMOVED"
        and group["name"] not in live
    ]
    for name in orphans:
        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass
    return orphans


def wait_gone(cluster: str, names: list[str], timeout_s: float = 30.0) -> list[str]:
    """Names still alive as actors after the timeout (ray.kill is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [n for n in names if n in actor_names(cluster)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _group_name(cluster: str, worker: str) -> str:
    return f"{namespace(cluster)}-{worker}"
