"""`pdserve k8s render`: a cluster file's Kubernetes overlay (pdserve/cluster/k8s_render.py), so the
manifests in deploy/k8s/overlays/ are rendered from deploy/clusters/ and never edited apart."""

import argparse
import sys
from pathlib import Path

from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file


def add_parser(subparsers) -> None:
    from pdserve.cluster.k8s_render import GPUS_PER_NODE, MODES

    parser = subparsers.add_parser(
        "k8s", help="Kubernetes manifests from a cluster file", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="k8s_command", required=True, metavar="COMMAND")
    render = commands.add_parser(
        "render",
        help="write a cluster file's kustomize overlay",
        description="Write the kustomize overlay (kustomization.yaml, pdserve.yaml) of a "
        "cluster file on top of deploy/k8s/base, with gateway/ (InferencePool, HTTPRoute, "
        "endpoint picker) and, in deployments mode, autoscaling/ (a KEDA ScaledObject per pool) "
        "beside it.",
    )
    render.add_argument("-f", "--file", required=True, type=Path, help="the cluster file (YAML)")
    render.add_argument(
        "--mode",
        choices=MODES,
        default="deployments",
        help="deployments: one Deployment per pool, no Ray; kuberay: a RayCluster and a Job "
        "running `pdserve up` on it (default: deployments)",
    )
    render.add_argument(
        "--gpus-per-node",
        type=int,
        default=GPUS_PER_NODE,
        metavar="N",
        help="GPUs of a node: a prefill pool whose TP group needs more renders as a "
        f"LeaderWorkerSet of TP/N pods per worker (default: {GPUS_PER_NODE})",
    )
    render.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to write it (default: deploy/k8s/overlays/<file name>/<mode>)",
    )
    render.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.cluster.k8s_render import OVERLAYS, render, write

    out = (args.out or OVERLAYS / args.file.stem / args.mode).resolve()
    try:
        files = render(load_cluster_file(args.file), args.mode, out, args.gpus_per_node)
    except ConfigError as error:
        print(f"pdserve k8s render: refused: {error}", file=sys.stderr)
        return 2
    write(files, out)
    print(f"wrote {out}: kubectl apply -k {out}", file=sys.stderr)
    return 0
