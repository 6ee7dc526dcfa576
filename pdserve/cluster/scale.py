"""`pdserve scale --prefill N --decode M`: change the ratio of a running cluster, live.

On a cluster of flex workers (the file's `flex:` pool) nothing starts or stops: the router gives
the workers their new roles (`POST /pdserve/roles`), in effect from its next request on.

On a fixed-role cluster, new workers start first and join the pools (the router follows the
registry); then surplus workers drain: each leaves the pools, keeps serving for a grace period
while the router's view catches up, finishes its requests in flight, and only then stops. The
newest workers go first.
The replica keeper's list is the cluster's workers: scale reads it, and tells the keeper what to
keep once the new workers have joined and before the surplus ones drain, so the keeper neither
replaces a worker scale stops nor misses one it started.
"""

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from pdserve.cluster import ray_launcher, replica_keeper
from pdserve.cluster.cluster_state import ClusterState
from pdserve.cluster.cluster_target import add_target_arguments, router_roles, target_state
from pdserve.cluster.console import say
from pdserve.cluster.local_workers import threads_per_worker
from pdserve.cluster.placement import check_resources, worker_slots
from pdserve.cluster.up import wait_joined
from pdserve.core.kinds import Role
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file
from pdserve.worker.drain import request_drain

DRAIN_TIMEOUT_S = 600.0  # the longest a request may take (router.request_timeout_s)
ROLES = (Role.PREFILL, Role.DECODE)  # the pools of a fixed-role cluster


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "scale",
        help="change a running cluster's prefill:decode ratio",
        description=__doc__.splitlines()[0],
    )
    add_target_arguments(parser)
    parser.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="prefill workers wanted (default: unchanged); on a flex cluster, flex workers "
        "in the prefill role",
    )
    parser.add_argument(
        "--decode",
        type=int,
        default=None,
        metavar="M",
        help="decode workers wanted, at least 1 (default: unchanged); on a flex cluster, flex "
        "workers in the decode role (with only one of the two given, the rest take the other)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="how long a leaving worker may take to finish its requests before it "
        f"stops anyway (default: {DRAIN_TIMEOUT_S:.0f}; a flex cluster stops none)",
    )
    parser.set_defaults(run=run)


def check_single_node_workers(config) -> None:
    """`scale` adds and removes workers one by one; a pool whose replicas are groups of
    several workers (a data-parallel group over nodes) is refused rather than left half a group."""
    for role in ROLES:
        pool = config.pool(role)
        if pool.workers_per_replica > 1:
            raise ConfigError(
                f"{role}: its replicas are data-parallel groups of {pool.workers_per_replica} "
                "workers (data_parallel_size_local < data_parallel_size), which scale does not "
                "add or remove; change replicas and run `pdserve up` again"
            )


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        state = target_state(args)
        config = load_cluster_file(state.config_path)
        if args.decode is not None and args.decode < 1:
            raise ConfigError("--decode: at least 1 decode worker is needed")
        if args.prefill is not None and args.prefill < 0:
            raise ConfigError("--prefill: must be >= 0")
        if config.is_flex:
            return move_roles(state, args.prefill, args.decode, started)
        check_single_node_workers(config)
        ray_launcher.connect(state.ray_address, state.name, state.ray_token())
        kept = replica_keeper.kept_names()
        current = {role: [name for name in kept if name.startswith(f"{role}-")] for role in ROLES}
        wanted = {
            "prefill": len(current["prefill"]) if args.prefill is None else args.prefill,
            "decode": len(current["decode"]) if args.decode is None else args.decode,
        }
        adding = {role: max(0, wanted[role] - len(current[role])) for role in ROLES}
        next_index = {role: 1 + max(map(_index, current[role]), default=-1) for role in ROLES}
        new_slots = worker_slots(config, adding, next_index)
        check_resources(new_slots, _free_resources())
    except ConfigError as error:
        say(f"pdserve scale: refused: {error}")
        return 2
    except RuntimeError as error:
        say(f"pdserve scale: {error}")
        return 1
    say("scaling " + ", ".join(f"{role} {len(current[role])} -> {wanted[role]}" for role in ROLES))
    if new_slots:
        total = sum(wanted.values())
        try:
            for slot in new_slots:
                say(f"starting {slot.name}")
                ray_launcher.start_worker(
                    state.name,
                    slot,
                    config.worker_settings(slot.role, state.registry_url),
                    state.log_dir,
                    threads_per_worker(total),
                    state.loopback,
                    config.kv_pool.budget_bytes,
                )
            wait_joined(config, state, new_slots)
        except (RuntimeError, TimeoutError) as error:
            say(f"pdserve scale: {error}; removing the new workers")
            ray_launcher.stop_actors(state.name, [slot.name for slot in new_slots])
            return 1
    leaving = [name for role in ROLES for name in sorted(current[role], key=_index)[wanted[role] :]]
    staying = [name for name in kept if name not in leaving] + [slot.name for slot in new_slots]
    try:
        replica_keeper.keep(staying)
    except RuntimeError as error:
        say(f"pdserve scale: {error}; no worker leaves")
        return 1
    with ThreadPoolExecutor(max_workers=max(1, len(leaving))) as pool:  # drain side by side
        drained = list(pool.map(lambda name: drain(name, args.drain_timeout), leaving))
    ray_launcher.stop_actors(state.name, leaving)
    ray_launcher.wait_gone(state.name, leaving)
    say(
        f"scaled to {wanted['prefill']} prefill + {wanted['decode']} decode in "
        f"{time.monotonic() - started:.1f} s"
    )
    return 0 if all(drained) else 1


def move_roles(state: ClusterState, prefill: int | None, decode: int | None, started: float) -> int:
    """The flex cluster's new split, set by its router; prints each worker that moved."""
    split = {key: n for key, n in (("prefill", prefill), ("decode", decode)) if n is not None}
    if not split:
        raise ConfigError("give --prefill and/or --decode")
    reply = router_roles(state, split)
    for change in reply["changes"]:
        say(f"{change['worker']}: {change['from']} -> {change['to']}")
    counts = reply["flex"]
    standby = f" ({counts['standby']} on standby)" if counts["standby"] else ""
    say(
        f"roles set to {counts['prefill']} prefill + {counts['decode']} decode{standby} in "
        f"{time.monotonic() - started:.2f} s ({len(reply['changes'])} worker(s) moved, no "
        "engine restarted)"
    )
    return 0


def drain(name: str, timeout_s: float) -> bool:
    """Ask the worker to drain; True when nothing was left in flight."""
    try:
        address = ray_launcher.describe(name).address
    except RuntimeError:
        address = ""
    if not address:
        say(f"{name}: no address (already gone); stopping it")
        return True
    say(f"draining {name} ({address})")
    try:
        reply = request_drain(address, timeout_s)
    except grpc.RpcError as error:
        say(f"{name}: drain failed ({error.code().name}: {error.details()}); stopping it")
        return False
    say(
        f"{name}: drained in {reply.seconds:.1f} s"
        + ("" if reply.drained else f", {reply.requests_left} request(s) cut at the timeout")
    )
    return reply.drained


def _index(name: str) -> int:
    return int(name.split("-")[1])  # "decode-3" -> 3: higher is newer


def _free_resources() -> list[dict[str, float]]:
    from ray._private.state import available_resources_per_node

    return list(available_resources_per_node().values())
