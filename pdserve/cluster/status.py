"""`pdserve status`: each pool's workers with their load and placement (node, GPU ids), from
the registry (what the router sees) and from Ray (what runs), and what the replica keeper does
(workers it keeps, replacements so far, back-offs, its metrics URL and latest events), and each
node's KV pool store with its figures. A flex worker's current role comes from the router, which
assigns it."""

import argparse
import json
import sys
from dataclasses import asdict

from pdserve.cluster import ray_launcher, replica_keeper
from pdserve.cluster.cluster_state import ClusterState
from pdserve.cluster.cluster_target import add_target_arguments, router_roles, target_state
from pdserve.core.kinds import Role
from pdserve.protocol.registry import load_figures, read_members
from pdserve.settings.base import ConfigError
from pdserve.settings.redis_url import masked


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show a cluster's pools, load and placement",
        description=__doc__.splitlines()[0],
    )
    add_target_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        state = target_state(args)
        ray_launcher.connect(state.ray_address, state.name, state.ray_token())
    except (ConfigError, RuntimeError) as error:
        print(f"pdserve status: {error}", file=sys.stderr)
        return 1
    members = {r.identity.worker_id: r for r in read_members(state.registry_url, state.name)}
    try:
        keeper = replica_keeper.report()
    except RuntimeError as error:
        keeper = None
        keeper_view = {"error": str(error)}
    else:
        keeper_view = asdict(keeper)
    rows = []
    names = ray_launcher.actor_names(state.name)
    pools = [n for n in names if ray_launcher.is_kv_pool(n)]
    running = [
        n for n in names if n not in (ray_launcher.ROUTER, replica_keeper.KEEPER) and n not in pools
    ]
    for name in running:
        record = members.pop(name, None)
        try:
            actor = ray_launcher.describe(name)
        except RuntimeError:
            actor = None
        rows.append(
            {
                "worker": name,
                "role": record.identity.role if record else name.split("-")[0],
                "state": "in pool"
                if record
                else ("exited" if actor and actor.exit_code is not None else "not in pool"),
                "address": record.address if record else (actor.address if actor else ""),
                "node": actor.node if actor else "",
                "gpu_ids": list(actor.gpu_ids) if actor else [],
                "pid": actor.pid if actor else None,
                "tensor_parallel_size": record.identity.tensor_parallel_size if record else None,
                "load": load_figures(record.load) if record else None,
            }
        )
    for name in keeper.keeping if keeper else ():
        if name in running:
            continue
        members.pop(name, None)  # a record left by the dead worker: it expires
        rows.append(  # kept, with no actor: its replacement is on the way
            {
                "worker": name,
                "role": name.split("-")[0],
                "state": "replacing",
                "address": "",
                "node": "",
                "gpu_ids": [],
                "pid": None,
                "tensor_parallel_size": None,
                "load": None,
            }
        )
    rows += [
        {
            "worker": r.identity.worker_id,
            "role": r.identity.role,
            "state": "in pool, not ours",
            "address": r.address,
            "node": r.node,
            "gpu_ids": list(r.gpu_ids),
            "pid": None,
            "tensor_parallel_size": r.identity.tensor_parallel_size,
            "load": load_figures(r.load),
        }
        for r in members.values()
    ]
    report = {
        "name": state.name,
        "router": state.router_url,
        "ray": state.ray_address,
        "registry": masked(state.registry_url),
        "workers": rows,
        "kv_pools": [_kv_pool_view(name) for name in pools],
        "keeper": keeper_view,
    }
    if any(row["role"] == Role.FLEX for row in rows):
        report["flex"] = flex_roles(state, rows)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def flex_roles(state: ClusterState, rows: list[dict]) -> dict:
    """Sets each flex row's `serves` (prefill, decode, standby) from the router; returns the
    split, or {"error": why} when the router cannot say."""
    try:
        view = router_roles(state)
    except (ConfigError, RuntimeError) as error:
        return {"error": str(error)}
    serves = {worker["worker"]: worker["role"] for worker in view["workers"] if worker["flex"]}
    for row in rows:
        if row["role"] == Role.FLEX:
            row["serves"] = serves.get(row["worker"], "")
    return view["flex"]


def _kv_pool_view(name: str) -> dict:
    """A node's KV pool actor's description with its store's figures (`stats`, None while
    the store does not answer), or {"error": why}."""
    try:
        process = ray_launcher.describe(name)
    except RuntimeError as error:
        return {"error": str(error)}
    stats = ray_launcher.kv_pool_stats(name)
    return {**asdict(process), "stats": asdict(stats) if stats else None}


def _table(report: dict) -> str:
    lines = [
        f"cluster {report['name']}: router {report['router']}  ray {report['ray']}  "
        f"registry {report['registry']}",
        f"{'worker':<11} {'role':<12} {'state':<12} {'address':<21} {'node':<14} "
        f"{'GPUs':<6} {'run':>4} {'wait':>4} {'KV blocks':>11} {'µs/token fetch/load/compute':>27}",
    ]
    for row in sorted(report["workers"], key=lambda r: (r["role"], r["worker"])):
        load = row["load"] or {}
        kv = f"{load['kv_blocks_used']}/{load['kv_blocks_total']}" if load else "-"
        role = f"{row['role']}/{row['serves']}" if row.get("serves") else row["role"]
        lines.append(
            f"{row['worker']:<11} {role:<12} {row['state']:<12} "
            f"{row['address']:<21} {row['node'][:12]:<14} "
            f"{','.join(row['gpu_ids']) or '-':<6} {load.get('running_requests', '-'):>4} "
            f"{load.get('waiting_requests', '-'):>4} {kv:>11} {_per_token(load):>27}"
        )
    for pool in report["kv_pools"]:
        lines.append(_kv_pool_line(pool))
    if flex := report.get("flex"):
        lines.append(
            f"flex roles: {flex['error']}"
            if "error" in flex
            else f"flex roles: {flex['prefill']} prefill, {flex['decode']} decode, "
            f"{flex['standby']} standby (set with pdserve scale)"
        )
    keeper = report["keeper"]
    if "error" in keeper:
        lines.append(f"replica keeper: {keeper['error']}")
        return "\n".join(lines)
    waiting = ", ".join(f"{name} in {s:g} s" for name, s in keeper["waiting"].items())
    lines += [
        f"replica keeper: keeping {len(keeper['keeping'])} worker(s); replacements "
        + ", ".join(f"{role} {n}" for role, n in keeper["replacements"].items())
        + "; failed starts "
        + ", ".join(f"{role} {n}" for role, n in keeper["failed_starts"].items())
        + (f"; waiting: {waiting}" if waiting else "")
        + f"; metrics {keeper['metrics_url']}",
        *(f"  {event}" for event in keeper["events"][-5:]),
    ]
    return "\n".join(lines)


def _per_token(load: dict) -> str:
    """A prompt token's fetch from another host's KV pool and load from its own against its
    compute, in µs, as the worker measured them (what the routers count a fetch and a load as
    saving: docs/kv-pool.md#routing)."""

    def us(seconds: float) -> str:
        return f"{seconds * 1e6:.0f}" if seconds else "-"

    if not load:
        return "-"
    names = ("kv_pool_fetch", "kv_pool_load", "prefill")
    return "/".join(us(load.get(f"{name}_seconds_per_token", 0.0)) for name in names)


def _kv_pool_line(pool: dict) -> str:
    if "error" in pool:
        return f"KV pool: {pool['error']}"
    where = f"KV pool on node {pool['node'][:12]} ({pool['address']}, pid {pool['pid']})"
    stats = pool.get("stats")
    if pool.get("exit_code") is not None or stats is None:
        return f"{where}: not answering (exit code {pool.get('exit_code')}); log {pool['log']}"
    gib = 2**30
    return (
        f"{where}: {stats['bytes'] / gib:.2f} of {stats['budget_bytes'] / gib:.2f} GiB, "
        f"{stats['used']} blocks, {stats['hits']} hits, {stats['evictions']} evicted, "
        f"{stats['dropped']} dropped"
    )
