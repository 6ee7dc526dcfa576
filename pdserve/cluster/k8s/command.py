"""`pdserve k8s render`: a cluster file's Kubernetes manifests (pdserve/cluster/k8s/render.py),
standing alone, with the namespace, images, storage, secrets, scheduling and sizes a deployment
chooses; the manifests in deploy/k8s/overlays/ are rendered from deploy/clusters/ this way."""

import argparse
import sys
from pathlib import Path

from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not (key and sep):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _rdma(text: str):
    from pdserve.cluster.k8s.fabric import Rdma

    try:
        return Rdma.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _toleration(text: str):
    from pdserve.cluster.k8s.scheduling import Toleration

    try:
        return Toleration.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(subparsers) -> None:
    from pdserve.cluster.k8s.options import RenderOptions
    from pdserve.cluster.k8s.render import MODES
    from pdserve.cluster.k8s.scheduling import GPU_PRODUCT_LABEL, GPU_TAINT

    defaults = RenderOptions()
    parser = subparsers.add_parser(
        "k8s", help="Kubernetes manifests from a cluster file", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="k8s_command", required=True, metavar="COMMAND")
    render = commands.add_parser(
        "render",
        help="write a cluster file's Kubernetes manifests",
        description="Write a cluster file's manifests to a folder that stands alone: "
        "pdserve.yaml (the namespace, Redis, the router Service, NetworkPolicies, the model "
        "cache and the Job that fills it, the workers and the router, or a KubeRay RayJob) with "
        "its kustomization.yaml, and beside it gateway/ (InferencePool, HTTPRoute, endpoint "
        "picker), monitoring/ (ServiceMonitor, PodMonitor, PrometheusRule) and, in deployments "
        "mode, autoscaling/ (a KEDA ScaledObject per pool), each applied once its CRDs are.",
    )
    render.add_argument("-f", "--file", required=True, type=Path, help="the cluster file (YAML)")
    render.add_argument(
        "--mode",
        choices=MODES,
        default="deployments",
        help="deployments: one Deployment per pool, no Ray; kuberay: a KubeRay RayJob running "
        "`pdserve up` on its cluster once the cluster is ready (default: deployments)",
    )
    render.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to write it (default: k8s/overlays/<file name>/<mode> beside the cluster "
        "file's folder: deploy/k8s/overlays/... for deploy/clusters/...)",
    )
    render.add_argument(
        "--namespace",
        default=defaults.namespace,
        help=f"the namespace of every object, created by the output (default: "
        f"{defaults.namespace})",
    )
    render.add_argument(
        "--image-registry",
        default=defaults.image_registry,
        metavar="REGISTRY",
        help="where the pdserve images are pushed: pods run REGISTRY/pdserve:TAG-cpu|gpu "
        "(default: none, the local names pdserve:TAG-cpu|gpu)",
    )
    render.add_argument(
        "--image-tag",
        default=defaults.image_tag,
        metavar="TAG",
        help="the images' tag before -cpu or -gpu (default: this pdserve's version)",
    )
    render.add_argument(
        "--storage-class",
        default=defaults.storage_class,
        metavar="CLASS",
        help="the model cache claim's StorageClass; on GPU clusters it must offer "
        "ReadWriteMany (NFS, EFS, Filestore, CephFS) and let uid/gid 1000 write (default: the "
        "cluster's default class)",
    )
    render.add_argument(
        "--model-cache-size",
        default=defaults.model_cache_size,
        metavar="SIZE",
        help="the model cache claim's size, e.g. 500Gi (default: the checkpoint's size plus a "
        "quarter and 10 GiB where the model is known, else 200Gi on GPU, 10Gi on CPU)",
    )
    render.add_argument(
        "--hf-token-secret",
        default=defaults.hf_token_secret,
        metavar="SECRET",
        help="a Secret whose key `token` is a Hugging Face token (gated models such as Llama): "
        "the model fetch Job, the workers and the router get it as HF_TOKEN, and do not start "
        "without it (default: none, no token)",
    )
    render.add_argument(
        "--node-selector",
        type=_label,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help=f"a label GPU worker pods require of their node, repeatable; given, it replaces "
        f"the one from each pool's gpu_type ({GPU_PRODUCT_LABEL}=<its product>, set by NVIDIA's "
        "GPU feature discovery); `--node-selector none=` requires nothing",
    )
    render.add_argument(
        "--toleration",
        type=_toleration,
        action="append",
        default=None,
        metavar="KEY[=VALUE][:EFFECT]",
        help="a taint GPU worker pods tolerate, repeatable; given, it replaces the default "
        f"({GPU_TAINT.key}:{GPU_TAINT.effect})",
    )
    render.add_argument(
        "--gpus-per-node",
        type=int,
        default=defaults.gpus_per_node,
        metavar="N",
        help="GPUs of a node: a prefill pool whose TP group needs more renders as a "
        f"LeaderWorkerSet of TP/N pods per worker (default: {defaults.gpus_per_node})",
    )
    render.add_argument(
        "--router-cpu",
        default=defaults.router_cpu,
        metavar="CPU",
        help=f"a router pod's CPU request (default: {defaults.router_cpu})",
    )
    render.add_argument(
        "--router-memory",
        default=defaults.router_memory,
        metavar="SIZE",
        help=f"a router pod's memory request and limit (default: {defaults.router_memory})",
    )
    render.add_argument(
        "--cpus-per-gpu",
        type=int,
        default=defaults.cpus_per_gpu,
        metavar="N",
        help=f"CPUs a GPU worker pod requests per GPU (default: {defaults.cpus_per_gpu})",
    )
    render.add_argument(
        "--memory-per-gpu-gib",
        type=int,
        default=defaults.memory_per_gpu_gib,
        metavar="GIB",
        help="host memory a GPU worker pod requests (and is limited to) per GPU, for loading "
        f"weights and the pinned KV buffers (default: {defaults.memory_per_gpu_gib})",
    )
    render.add_argument(
        "--release-label",
        default=defaults.release_label,
        metavar="RELEASE",
        help="the `release` label of the ServiceMonitor, PodMonitor and PrometheusRule: the "
        "Helm release of the kube-prometheus-stack that should select them (default: "
        f"{defaults.release_label})",
    )
    render.add_argument(
        "--prometheus-url",
        default=defaults.prometheus_url,
        metavar="URL",
        help=f"the Prometheus the autoscalers query (default: {defaults.prometheus_url})",
    )
    render.add_argument(
        "--tls-secret",
        default=defaults.tls_secret,
        metavar="SECRET",
        help="mutual TLS on every gRPC channel between pods (router to workers, KV streams): a "
        "Secret with the cluster's ca.crt, tls.crt and tls.key (cert-manager's keys; from "
        "scripts/make_tls_dir.py, docs/kubernetes.md says how), mounted in every pdserve "
        "container; the workers' probes then ask a plaintext health-only port (default: none, "
        "plaintext inside the cluster)",
    )
    render.add_argument(
        "--tls-issuer",
        default=defaults.tls_issuer,
        metavar="KIND/NAME",
        help="cert-manager makes and renews the --tls-secret (default name pdserve-tls): a "
        "Certificate for the name `pdserve` signed by this CA Issuer or ClusterIssuer, e.g. "
        "ClusterIssuer/cluster-ca (default: none, you create the Secret)",
    )
    render.add_argument(
        "--rdma",
        type=_rdma,
        default=None,
        metavar="RESOURCE=N",
        help="GPU worker pods take N of the RDMA device plugin's RESOURCE (e.g. rdma/ib=1) for "
        "NCCL's KV between pods, with the IPC_LOCK capability its registered memory needs (the "
        "namespace then enforces no Pod Security level: IPC_LOCK is beyond baseline) "
        "(default: none, NCCL over TCP)",
    )
    render.add_argument(
        "--fabric-key",
        default=defaults.fabric_key,
        metavar="LABEL",
        help="worker pods prefer nodes whose LABEL value the pods they move KV with have: a "
        "fabric, rail or NVLink domain label keeps a P/D pair's KV on one fabric; '' for no "
        f"affinity (default: {defaults.fabric_key})",
    )
    render.set_defaults(run=run)


def options_of(args: argparse.Namespace):
    """The RenderOptions the flags ask for."""
    from pdserve.cluster.k8s.options import RenderOptions
    from pdserve.cluster.k8s.tls import CERTIFICATE_SECRET

    selector = args.node_selector
    if selector is not None:
        selector = {key: value for key, value in selector if key != "none"}
    return RenderOptions(
        namespace=args.namespace,
        image_registry=args.image_registry,
        image_tag=args.image_tag,
        storage_class=args.storage_class,
        model_cache_size=args.model_cache_size,
        hf_token_secret=args.hf_token_secret,
        node_selector=selector,
        tolerations=None if args.toleration is None else tuple(args.toleration),
        gpus_per_node=args.gpus_per_node,
        router_cpu=args.router_cpu,
        router_memory=args.router_memory,
        cpus_per_gpu=args.cpus_per_gpu,
        memory_per_gpu_gib=args.memory_per_gpu_gib,
        release_label=args.release_label,
        prometheus_url=args.prometheus_url,
        tls_secret=args.tls_secret or (CERTIFICATE_SECRET if args.tls_issuer else ""),
        tls_issuer=args.tls_issuer,
        rdma=args.rdma,
        fabric_key=args.fabric_key,
    )


def check_fit(config) -> None:
    """What `pdserve up` checks before it starts anything, checked before anything is rendered:
    the model's heads against each pool's tensor-parallel size, and each GPU pool's weights, KV
    cache, activations and buffers against its card (a file that did not fit was rendered, to
    fail on the cluster: GPU review §1 row 6). A file of CPU pools only is not checked: its
    model need not be on the host that renders it."""
    from pdserve.cluster.placement import check_layout, check_memory, memory_use, model_shape

    if not any(pool.replicas and pool.uses_gpus for pool in config.pools().values()):
        return
    model = model_shape(config)
    check_layout(config, model)
    check_memory(memory_use(config, model))


def run(args: argparse.Namespace) -> int:
    from pdserve.cluster.k8s.render import default_out, render, write

    out = (args.out or default_out(args.file, args.mode)).resolve()
    try:
        config = load_cluster_file(args.file)
        check_fit(config)
        files = render(config, args.mode, options_of(args))
    except ConfigError as error:
        print(f"pdserve k8s render: refused: {error}", file=sys.stderr)
        return 2
    write(files, out)
    print(f"wrote {out}: kubectl apply -k {out}", file=sys.stderr)
    return 0
