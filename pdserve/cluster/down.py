"""`pdserve down`: remove exactly what `pdserve up` created — the replica keeper (first, so it
starts nothing again), the router and worker actors and their placement groups in the cluster's
namespace, the nodes' KV pool stores, the cluster's secrets in Ray, the registry entries, and the
Ray head (and its token) and Redis server if `up` started them — and nothing else."""

import argparse
import sys
from pathlib import Path

from pdserve.cluster import local_services, ray_launcher, replica_keeper
from pdserve.cluster.cluster_state import ClusterState, forget_state
from pdserve.cluster.cluster_target import add_target_arguments, target_state
from pdserve.cluster.console import say
from pdserve.protocol.registry import clear_members
from pdserve.settings.base import ConfigError
from pdserve.settings.redis_url import masked
from pdserve.worker.processes import stop_group


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "down", help="remove what `pdserve up` created", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        state = target_state(args)
    except ConfigError as error:
        print(f"pdserve down: {error}", file=sys.stderr)
        return 1
    tear_down(state)
    return 0


def tear_down(state: ClusterState) -> None:
    """Best effort on every step, so a half-started or half-dead cluster still goes away."""
    try:
        if not state.ray_address:  # `up` failed before Ray: no address to connect to
            raise RuntimeError("not started")
        ray_launcher.connect(state.ray_address, state.name, state.ray_token())
        if replica_keeper.stop(state.name):
            say(f"stopped the {replica_keeper.KEEPER}")
        names = ray_launcher.actor_names(state.name)
        say(f"stopping {', '.join(names) or 'no actors'}")
        if ray_launcher.ROUTER in names:  # no new requests first
            ray_launcher.stop_actors(state.name, [ray_launcher.ROUTER])
        pools = [n for n in names if ray_launcher.is_kv_pool(n)]
        ray_launcher.stop_actors(
            state.name, [n for n in names if n != ray_launcher.ROUTER and n not in pools]
        )
        ray_launcher.stop_actors(state.name, pools)  # the nodes' KV pools once no worker uses them
        if left := ray_launcher.wait_gone(state.name, names):
            say(f"still alive after ray.kill: {', '.join(left)}")
        if orphans := ray_launcher.remove_orphan_groups(state.name):
            say(f"freed the placement groups of dead workers: {', '.join(orphans)}")
        ray_launcher.forget_member_secrets()
        ray_launcher.ray.shutdown()
    except Exception as error:  # Ray gone already: its actors went with it
        say(f"ray at {state.ray_address}: {error}")
    if not state.redis_group:  # a shared Redis keeps its data; remove this cluster's entries
        try:
            removed = clear_members(state.registry_url, state.name)
            say(f"removed {removed} registry entr{'y' if removed == 1 else 'ies'}")
        except Exception as error:
            say(f"registry at {masked(state.registry_url)}: {error}")
    if state.ray_group:
        say(f"stopping the ray head (process group {state.ray_group})")
        local_services.stop_ray_head(state.ray_group)
    if state.ray_token_path:  # the token of the head `up` started: no use once it is gone
        Path(state.ray_token_path).unlink(missing_ok=True)
    if state.redis_group:
        say(f"stopping the redis-server (process group {state.redis_group})")
        stop_group(state.redis_group)
    forget_state(state.name)
    say(f"cluster {state.name!r} is down")
