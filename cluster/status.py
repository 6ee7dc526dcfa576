"""`pdserve status`: each pool's workers with their load and placement (node, GPU ids), from
the registry (what the router sees) and from Ray (what runs)."""

import argparse
import json
import sys
from dataclasses import asdict

from cluster import ray_launcher
from cluster.cluster_target import add_target_arguments, target_state
from settings.base import ConfigError
from worker.registry import read_members


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
        ray_launcher.connect(state.ray_address, state.name)
    except (ConfigError, RuntimeError) as error:
        print(f"pdserve status: {error}", file=sys.stderr)
        return 1
    members = {r.worker_id: r for r in read_members(state.registry_url, state.name)}
    rows = []
    for name in ray_launcher.actor_names(state.name):
        if name == ray_launcher.ROUTER:
            continue
        record = members.pop(name, None)
        actor = ray_launcher.describe(name)
        rows.append(
            {
                "worker": name,
                "role": record.role if record else name.split("-")[0],
                "state": "in pool"
                if record
                else ("exited" if actor.get("exit_code") is not None else "not in pool"),
                "address": record.address if record else actor.get("address", ""),
                "node": actor.get("node", ""),
                "gpu_ids": actor.get("gpu_ids", []),
                "pid": actor.get("pid"),
                "tensor_parallel_size": record.tensor_parallel_size if record else None,
                "load": asdict(record.load) if record else None,
            }
        )
    rows += [
        {
            "worker": r.worker_id,
            "role": r.role,
            "state": "in pool, not ours",
            "address": r.address,
            "node": r.node,
            "gpu_ids": list(r.gpu_ids),
            "pid": None,
            "tensor_parallel_size": r.tensor_parallel_size,
            "load": asdict(r.load),
        }
        for r in members.values()
    ]
    report = {
        "name": state.name,
        "router": state.router_url,
        "ray": state.ray_address,
        "registry": state.registry_url,
        "workers": rows,
    }
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _table(report: dict) -> str:
    lines = [
        f"cluster {report['name']}: router {report['router']}  ray {report['ray']}  "
        f"registry {report['registry']}",
        f"{'worker':<11} {'role':<8} {'state':<12} {'address':<21} {'node':<14} "
        f"{'GPUs':<6} {'run':>4} {'wait':>4} {'KV blocks':>11}",
    ]
    for row in sorted(report["workers"], key=lambda r: (r["role"], r["worker"])):
        load = row["load"] or {}
        kv = f"{load['kv_blocks_used']}/{load['kv_blocks_total']}" if load else "-"
        lines.append(
            f"{row['worker']:<11} {row['role']:<8} {row['state']:<12} "
            f"{row['address']:<21} {row['node'][:12]:<14} "
            f"{','.join(row['gpu_ids']) or '-':<6} {load.get('running_requests', '-'):>4} "
            f"{load.get('waiting_requests', '-'):>4} {kv:>11}"
        )
    return "\n".join(lines)
