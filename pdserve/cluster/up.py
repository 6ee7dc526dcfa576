"""`pdserve up -f cluster.yaml`: the cluster on Ray, its pools in Redis, the router in front.

Order: check everything (file, head layout, each GPU pool's memory, resources) before anything
starts; start what the file asks for that is not there (a local Ray head without --address, a
Redis server for an `embedded` registry); one placement group and actor per worker; wait until
every worker has joined the registry; start the router; start the replica keeper, which from
then on replaces a worker that dies (pdserve/cluster/replica_keeper.py); print the endpoint. A
failure on the way removes what was started. `--dry-run` stops after the checks and prints the
plan and each GPU pool's memory per GPU.

A `flex:` pool's workers (`flex-0`, ...) start like any other; the router gives each its role as
it joins (half prefill, rounded down), and `pdserve scale` changes the roles, not the workers.
"""

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

from pdserve.cluster import local_services, ray_launcher, replica_keeper
from pdserve.cluster.cluster_state import (
    RAY_AUTH_CHOICES,
    ClusterState,
    load_state,
    ray_token_file,
    save_state,
    state_dir,
)
from pdserve.cluster.console import say
from pdserve.cluster.local_workers import threads_per_worker
from pdserve.cluster.placement import (
    WorkerSlot,
    check_layout,
    check_memory,
    check_resources,
    describe_plan,
    memory_use,
    model_shape,
    worker_slots,
)
from pdserve.core.gpu_spec import local_gpus
from pdserve.protocol.registry import read_members
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import ClusterFile, load_cluster_file
from pdserve.settings.cluster_secret import cluster_secret, ensure_cluster_secret
from pdserve.settings.router import (
    ADMIN_ENV,
    ENV,
    OPERATOR_ENV,
    RouterSettings,
    is_loopback,
    open_refusal,
    unauthenticated_allowed,
)

JOIN_TIMEOUT_S = 600.0
ROUTER_TIMEOUT_S = 60.0
LOCAL_CPU_SLOTS = 16


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "up", help="start a cluster from a cluster file on Ray", description=__doc__.splitlines()[0]
    )
    parser.add_argument("-f", "--file", required=True, type=Path, help="the cluster file (YAML)")
    parser.add_argument(
        "--address",
        default="",
        help="an existing Ray cluster's address (default: start a local Ray "
        "head, which `pdserve down` stops)",
    )
    parser.add_argument(
        "--ray-auth",
        choices=RAY_AUTH_CHOICES,
        default="token",
        help="Ray's authentication (default: token: the local head `up` starts gets a new "
        "token, kept with the cluster's state (0600) for `down`, `status` and `scale`; with "
        "--address, your own Ray token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
        "~/.ray/auth_token). off: no auth, for a single-user host only: the local head is bound "
        "to 127.0.0.1, and `up` refuses when Ray listens elsewhere or --address is given",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=JOIN_TIMEOUT_S,
        metavar="S",
        help="how long the workers may take to load the model and join the registry before "
        f"`up` gives up and removes what it started (default: {JOIN_TIMEOUT_S:.0f}; a cold "
        "70B start takes longer)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the placement plan, each GPU pool's memory per GPU and the checks, start "
        "nothing; without --address the plan is made against the GPUs the file asks for (or "
        "--assume-gpus/--assume-nodes), not this host's",
    )
    parser.add_argument(
        "--assume-gpus",
        type=int,
        default=None,
        metavar="N",
        help="with --dry-run: plan against N GPUs in all (default: what the file asks for)",
    )
    parser.add_argument(
        "--assume-nodes",
        type=int,
        default=1,
        metavar="M",
        help="with --dry-run: ... spread evenly over M nodes (default: 1)",
    )
    parser.set_defaults(run=run)


def check_router_keys(router: RouterSettings, environ=os.environ) -> None:
    """The router `up` starts reads its keys from this environment (its actor inherits it): with
    none, on an address beyond loopback, it would refuse to start; refused here, before
    anything starts."""
    keys = any(environ.get(name, "").strip(", ") for name in (ENV, OPERATOR_ENV, ADMIN_ENV))
    if not keys and not is_loopback(router.host) and not unauthenticated_allowed(router, environ):
        raise ConfigError(open_refusal(f"router.host {router.host}"))


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        config = load_cluster_file(args.file)
        model = model_shape(config)
        check_layout(config, model)
        memory = memory_use(config, model)
        check_memory(memory)
        slots = worker_slots(config)
        check_router_keys(config.router_settings(""))
        if args.address and args.ray_auth == "off":
            raise ConfigError(
                "--ray-auth off: only for the local head `up` starts (it binds it to "
                "127.0.0.1); a cluster given by --address must run Ray's token auth"
            )
        if args.address:
            ray_launcher.connect(args.address, config.name)
            nodes = ray_launcher.node_resources()
        elif args.dry_run:
            nodes = assumed_nodes(slots, args.assume_gpus, args.assume_nodes)
            say(f"planning against {len(nodes)} assumed node(s), not this host")
        else:
            nodes = [local_node(slots)]
        check_resources(slots, nodes)
    except ConfigError as error:
        say(f"pdserve up: refused: {error}")
        return 2
    except RuntimeError as error:
        say(f"pdserve up: {error}")
        return 1
    say(describe_plan(slots))
    for use in memory:
        say(f"memory: {use.describe()}")
    say(
        "checks passed: head layout, "
        + ("GPU memory, " if memory else "")
        + f"{len(nodes)} node(s) with "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(_totals(nodes).items()))
    )
    if args.dry_run:
        say("dry run: nothing started")
        return 0
    try:
        previous = load_state(config.name)
    except ConfigError as error:
        say(f"pdserve up: refused: {error}")
        return 2
    if previous is not None:
        say(
            f"pdserve up: cluster {config.name!r} is already up (router {previous.router_url}); "
            f"run `pdserve down -f {args.file}` first"
        )
        return 1
    state = None
    try:
        state = start_services(config, args, nodes)
        for slot in slots:
            ray_launcher.start_worker(
                config.name,
                slot,
                config.worker_settings(slot.role, state.registry_url),
                state.log_dir,
                threads_per_worker(len(slots)),
                state.loopback,
                config.kv_pool.budget_bytes,
            )
        wait_joined(config, state, slots, args.join_timeout)
        router = ray_launcher.start_router(
            config.router_settings(state.registry_url), state.log_dir
        )
        state = replace(state, router_url=router.url)
        save_state(state)
        wait_router(router.url, len(slots))
        metrics_url = replica_keeper.start(
            config.name,
            config,
            state.registry_url,
            state.log_dir,
            state.loopback,
            [slot.name for slot in slots],
        )
    except (RuntimeError, ConfigError, TimeoutError, OSError) as error:
        say(f"pdserve up: {error}")
        state = state or load_state(config.name)  # start_services saves as it goes
        if state is not None:
            from pdserve.cluster.down import tear_down

            say("removing what was started")
            tear_down(state)
        return 1
    flex_note = (
        "flex workers: the router splits them (half prefill, rounded down); "
        f"`pdserve scale -f {args.file} --prefill N` moves them\n"
        if config.is_flex
        else ""
    )
    say(
        f"pdserve up: {len(slots)} worker(s) and the router ready after "
        f"{time.monotonic() - started:.0f} s\n"
        f"endpoint: {state.router_url}/v1 (model: {config.served_model})\n"
        f"replica keeper: replaces a worker that dies; metrics at {metrics_url}\n"
        f"{flex_note}logs: {state.log_dir}\nstop with: pdserve down -f {args.file}"
    )
    return 0


def start_services(config: ClusterFile, args, nodes) -> ClusterState:
    """Ray and Redis as the file asks; the state is saved at once, so `down` can undo a
    half-finished `up`. A local Ray head runs token auth, its token in a new 0600 file beside
    the state (`--ray-auth off`: none, bound to 127.0.0.1, refused if Ray listens elsewhere);
    the cluster's secrets go where its actors read them (ray_launcher.publish_member_secrets)."""
    log_dir = state_dir() / config.name / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    ensure_cluster_secret()  # one per cluster; its actors and workers get it (ray_launcher)
    state = ClusterState(
        cluster_secret=cluster_secret(),
        name=config.name,
        config_path=str(args.file.resolve()),
        ray_address=args.address,
        namespace=ray_launcher.namespace(config.name),
        registry_url=config.registry.url,
        router_url="",
        log_dir=str(log_dir),
        ray_auth=args.ray_auth,
    )
    if not config.registry.url:
        url, group = local_services.start_redis(log_dir / "redis.log")
        state = replace(state, registry_url=url, redis_group=group)
        save_state(state)
        say(f"registry: started redis-server at {url}")
    if not args.address:
        token = ray_token_file(config.name) if args.ray_auth == "token" else None
        if token is not None:
            local_services.write_ray_token(token)
        totals = _totals(nodes)
        address, group = local_services.start_ray_head(
            int(totals.get("CPU", 1)),
            int(totals.get("GPU", 0)),
            log_dir / "ray-head.log",
            token_path=token,
            auth=token is not None,
        )
        state = replace(
            state, ray_address=address, ray_group=group, ray_token_path=str(token or "")
        )
        save_state(state)
        auth = "token auth" if token else "no auth, bound to 127.0.0.1"
        say(f"ray: started a local head at {address} ({auth})")
    ray_launcher.connect(state.ray_address, config.name, state.ray_token())
    if state.ray_auth == "off":
        ray_launcher.check_loopback_nodes()
    ray_launcher.publish_member_secrets()  # what the actors read: never in their options
    state = replace(state, loopback=len(ray_launcher.node_resources()) == 1)
    save_state(state)
    return state


def wait_joined(
    config: ClusterFile,
    state: ClusterState,
    slots: list[WorkerSlot],
    timeout_s: float = JOIN_TIMEOUT_S,
) -> None:
    """Until every worker is in the registry (it joins once its engine is ready); fail fast with
    its log tail when one exits."""
    names = {slot.name for slot in slots}
    started = last_report = time.monotonic()
    while True:
        listed = read_members(state.registry_url, config.name)
        joined = names & {record.identity.worker_id for record in listed}
        if joined == names:
            say(f"{len(names)} worker(s) joined after {time.monotonic() - started:.0f} s")
            return
        for name in sorted(names - joined):
            try:
                info = ray_launcher.describe(name)
            except RuntimeError as error:
                raise RuntimeError(f"worker {name} stopped ({error})") from None
            if info.exit_code is not None:
                tail = ray_launcher.actor(name).log_tail.remote()
                raise RuntimeError(
                    f"worker {name} stopped ({info}):\n" + ray_launcher.ray.get(tail, timeout=10)
                )
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(
                f"workers not in the registry after {timeout_s:.0f} s: "
                + ", ".join(sorted(names - joined))
            )
        if time.monotonic() - last_report >= 10:
            last_report = time.monotonic()
            say(
                f"waiting for {len(names - joined)} worker(s) to load the model "
                f"({time.monotonic() - started:.0f} s; ~30 s each on CPU)"
            )
        time.sleep(0.5)


def wait_router(url: str, workers: int) -> None:
    """Until the router answers /health and sees every worker."""
    import httpx

    deadline = time.monotonic() + ROUTER_TIMEOUT_S
    seen = 0
    while time.monotonic() < deadline:
        try:
            seen = len(httpx.get(f"{url}/health", timeout=2).json().get("workers", []))
            if seen >= workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise TimeoutError(
        f"the router at {url} saw {seen} of {workers} workers after {ROUTER_TIMEOUT_S:.0f} s"
    )


def local_node(slots: list[WorkerSlot]) -> dict[str, float]:
    """This host as a Ray node: its GPUs, and logical CPUs for the CPU pools' bundles, which
    stand for worker slots (the workers split the real cores): at least LOCAL_CPU_SLOTS, so
    `pdserve scale` has room to add workers."""
    cpus_needed = sum(s.devices for s in slots if s.device == "CPU")
    return {
        "CPU": float(max(os.cpu_count() or 1, cpus_needed, LOCAL_CPU_SLOTS)),
        "GPU": float(local_gpus()),
    }


def assumed_nodes(slots: list[WorkerSlot], gpus: int | None, count: int) -> list[dict[str, float]]:
    """`count` nodes sharing `gpus` GPUs evenly (default: the GPUs the workers ask for), each
    with this host's CPU slots: what a dry run plans against when no Ray cluster is given."""
    if count < 1:
        raise ConfigError(f"--assume-nodes: must be >= 1, got {count}")
    wanted = sum(s.devices for s in slots if s.device == "GPU")
    total = wanted if gpus is None else gpus
    if total < 0:
        raise ConfigError(f"--assume-gpus: must be >= 0, got {total}")
    cpus = local_node(slots)["CPU"]
    return [
        {"CPU": cpus, "GPU": float(total // count + (index < total % count))}
        for index in range(count)
    ]


def _totals(nodes: list[dict[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for node in nodes:
        for key in ("CPU", "GPU"):
            totals[key] = totals.get(key, 0) + node.get(key, 0)
    return totals
