"""Kubernetes manifests from a cluster file: the overlay `pdserve k8s render` writes, on top of
deploy/k8s/base (namespace, Redis registry, router Service, model cache).

Two modes, the same pools:
- deployments: one Deployment per pool running `pdserve worker --role ROLE --registry ...`, and
  a router Deployment following the registry. Changing the P:D ratio is `kubectl scale
  deployment/pdserve-decode --replicas=N`. A worker pod drains in its preStop hook
  (pdserve/worker/drain.py) before SIGTERM, within terminationGracePeriodSeconds.
- kuberay: a RayCluster whose worker groups are the pools (one pdserve worker per pod: a
  pod offers its tensor-parallel group's GPUs) and a Job that runs `pdserve up` on the head
  through `ray job submit`, so Ray places TP groups exactly as on bare metal; the router runs on
  the head (behind the base's router Service).

Beside the overlay, kustomizations of their own for objects whose CRDs a cluster may lack:
gateway/ (pdserve/cluster/k8s_gateway.py) and, in deployments mode, autoscaling/
(pdserve/cluster/k8s_autoscaling.py). A flex cluster file renders one pool, `flex`.

Every number in the output comes from the cluster file or a constant here, so the committed
overlays are this module's output (a test renders them again and compares).
"""

import importlib.metadata
import json
import math
import os
from pathlib import Path

import yaml

from pdserve.cluster.k8s_autoscaling import scaled_object
from pdserve.cluster.k8s_gateway import gateway_objects
from pdserve.cluster.k8s_leader_worker import leader_worker_set, ray_follower_container
from pdserve.cluster.k8s_objects import NAMESPACE, NO_ESCALATION, NON_ROOT, labels, metadata
from pdserve.kinds import Role
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import ClusterFile, PoolSection

REDIS_URL = f"redis://redis.{NAMESPACE}.svc:6379/0"  # deploy/k8s/base/redis.yaml
ROUTER_PORT = 8000
GRPC_PORT = 50051
METRICS_PORT = 9400
KV_PORT = 50100  # decode: tensor-parallel rank r receives on KV_PORT + r
RAY_CLUSTER = "pdserve"  # KubeRay names the head's Service <name>-head-svc
MODES = ("deployments", "kuberay")
GPUS_PER_NODE = 8  # the usual GPU node; a TP group beyond it renders as a LeaderWorkerSet
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = DEPLOY / "k8s" / "overlays"
BASE = DEPLOY / "k8s" / "base"

# Pod sizes. CPU: a SmolLM2-class worker used 1.3 GiB beside its KV cache (measured); GPU: host
# memory for loading weights and the pinned KV send buffers.
CPU_WORKER_OVERHEAD_GIB = 3
CPUS_PER_GPU = 8
HOST_GIB_PER_GPU = 64
SHM = {"cpu": "1Gi", "gpu": "16Gi"}  # vLLM's TP message queues and NCCL use /dev/shm
DRAIN_MARGIN_S = 30  # beyond the longest request, for the drain's grace and the stop itself

SECRET_ENV = [
    {
        "name": "PDSERVE_CLUSTER_SECRET",
        "valueFrom": {"secretKeyRef": {"name": "pdserve-cluster-secret", "key": "secret"}},
    }
]
API_KEYS_ENV = [
    {
        "name": "PDSERVE_API_KEYS",
        "valueFrom": {
            "secretKeyRef": {"name": "pdserve-api-keys", "key": "keys", "optional": True}
        },
    }
]
REDIS_ENV = [  # router/shared_state.py and the registry authenticate with it
    {
        "name": "PDSERVE_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}},
    }
]
CACHE_ENV = [
    {"name": "PDSERVE_CACHE", "value": "/models/pdserve"},
    {"name": "HF_HOME", "value": "/models/huggingface"},
    {"name": "PDSERVE_LOG_FORMAT", "value": "json"},
]
POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def render(
    config: ClusterFile, mode: str, out: Path, gpus_per_node: int = GPUS_PER_NODE
) -> dict[str, str]:
    """The overlay's files (name -> text) for `config` in `mode`, written to `out`; a pool whose
    TP group needs more than `gpus_per_node` GPUs spans nodes (deployments mode only)."""
    for role, pool in _pools(config).items():
        if _spans_nodes(pool, gpus_per_node) and (
            mode != "deployments"
            or role != Role.PREFILL
            or pool.tensor_parallel_size % gpus_per_node
        ):
            raise ConfigError(
                f"{role}.tensor_parallel_size: {pool.tensor_parallel_size} GPUs span nodes of "
                f"{gpus_per_node}: only a prefill pool may (its KV receivers stay on one host "
                "otherwise), in deployments mode, on whole nodes"
            )
    base = os.path.relpath(BASE, out)
    objects = deployments(config, gpus_per_node) if mode == "deployments" else kuberay(config)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": NAMESPACE,
        "resources": [base, "pdserve.yaml"],
    }
    if not any(pool.uses_gpus for pool in _pools(config).values()):
        kustomization["patches"] = [_one_node_model_cache()]
    header = (
        f"# Rendered by `pdserve k8s render --mode {mode}` from the cluster file {config.name!r}:"
        "\n# edit the cluster file and render again rather than this file.\n"
    )
    files = {
        "kustomization.yaml": header + _yaml(kustomization),
        "pdserve.yaml": header + _yaml_stream(objects),
    }
    # Objects of CRDs a cluster may lack: kustomizations of their own, applied once the CRDs are.
    extras = {"gateway": gateway_objects(ROUTER_PORT)}
    if mode == "deployments":
        extras["autoscaling"] = [
            scaled_object(role, pool.replicas, _spans_nodes(pool, gpus_per_node))
            for role, pool in _pools(config).items()
        ]
    for folder, extra in extras.items():
        files[f"{folder}/kustomization.yaml"] = header + _yaml(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": NAMESPACE,
                "resources": [f"{folder}.yaml"],
            }
        )
        files[f"{folder}/{folder}.yaml"] = header + _yaml_stream(extra)
    return files


def write(files: dict[str, str], out: Path) -> None:
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


# Deployments mode ----------------------------------------------------------------------------


def deployments(config: ClusterFile, gpus_per_node: int) -> list[dict]:
    objects = [router_deployment(config), _pdb("router", 1)]
    for role, pool in _pools(config).items():
        if _spans_nodes(pool, gpus_per_node):
            workers = multi_node_workers(config, role, pool, gpus_per_node)
        else:
            workers = worker_deployment(config, role, pool)
        objects += [workers, _pdb(role, 1)]
    return objects


def worker_deployment(config: ClusterFile, role: str, pool: PoolSection) -> dict:
    spec = worker_pod_spec(config, role, pool, pool_resources(config, pool))
    # Without spare GPUs a rolling update replaces one pod at a time; on CPU it adds one first.
    surge = (
        {"maxSurge": 0, "maxUnavailable": 1}
        if pool.uses_gpus
        else {
            "maxSurge": 1,
            "maxUnavailable": 0,
        }
    )
    return _deployment(role, pool.replicas, spec, {"type": "RollingUpdate", "rollingUpdate": surge})


def multi_node_workers(config: ClusterFile, role: str, pool: PoolSection, gpus_per_node: int):
    """A pool whose TP group is larger than a node: a LeaderWorkerSet of groups, one pod per
    node; the leader runs the pdserve worker on a Ray head, the others lend it their GPUs."""
    resources = _gpu_resources(gpus_per_node)
    leader = worker_pod_spec(config, role, pool, resources)
    follower = {
        "securityContext": NON_ROOT,
        "containers": [
            ray_follower_container(
                _image(True), SECRET_ENV + REDIS_ENV + CACHE_ENV, resources, gpus_per_node
            )
        ],
        "volumes": _volumes(True),
        "tolerations": GPU_TOLERATIONS,
    }
    nodes = pool.tensor_parallel_size // gpus_per_node
    return leader_worker_set(role, pool.replicas, nodes, leader, follower)


def worker_pod_spec(config: ClusterFile, role: str, pool: PoolSection, resources: dict) -> dict:
    settings = config.worker_settings(role, _registry_url(config)).model_copy(
        update={
            "host": "0.0.0.0",
            "port": GRPC_PORT,
            "metrics_port": METRICS_PORT,
            "kv_port": KV_PORT if _receives_kv(role) else 0,
        }
    )
    ports = [
        {"name": "grpc", "containerPort": GRPC_PORT},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    if _receives_kv(role):
        ports += [
            {"name": f"kv-{rank}", "containerPort": KV_PORT + rank}
            for rank in range(pool.tensor_parallel_size)
        ]
    container = {
        "name": "worker",
        "image": _image(pool.uses_gpus),
        "args": [
            "worker",
            "--role",
            role,
            "--settings-json",
            json.dumps(settings.model_dump(mode="json", exclude_defaults=True)),
            "--worker-id",
            "$(POD_NAME)",
            "--advertise-host",
            "$(POD_IP)",
        ],
        "env": POD_ENV + SECRET_ENV + REDIS_ENV + CACHE_ENV,
        "ports": ports,
        "resources": resources,
        # Readiness: SERVING only with the engine READY; liveness: the process answers and its
        # engine has not failed (pdserve/worker/grpc_health.py). The start-up probe covers a model
        # download before the port opens.
        "startupProbe": _grpc_probe("liveness", period_s=10, failures=60),
        "readinessProbe": _grpc_probe("", period_s=5, failures=2),
        "livenessProbe": _grpc_probe("liveness", period_s=10, failures=6),
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        "python",
                        "-m",
                        "pdserve.worker.drain",
                        "--timeout",
                        str(config.router.request_timeout_s),
                    ]
                }
            }
        },
        "securityContext": NO_ESCALATION,
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    spec = {
        "terminationGracePeriodSeconds": _grace_s(config),
        "securityContext": NON_ROOT,
        "containers": [container],
        "volumes": _volumes(pool.uses_gpus),
    }
    if pool.uses_gpus:
        spec["tolerations"] = GPU_TOLERATIONS
    return spec


def router_deployment(config: ClusterFile) -> dict:
    settings = config.router_settings(_registry_url(config)).model_copy(
        update={"host": "0.0.0.0", "port": ROUTER_PORT}
    )
    container = {
        "name": "router",
        "image": _image(False),
        "args": [
            "router",
            "--settings-json",
            json.dumps(settings.model_dump(mode="json", exclude_defaults=True)),
        ],
        "env": SECRET_ENV + REDIS_ENV + API_KEYS_ENV + CACHE_ENV,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "resources": {
            "requests": {"cpu": "1", "memory": "2Gi"},
            "limits": {"memory": "4Gi"},
        },
        # /health is 503 while no decode worker is up: it gates traffic, never restarts.
        "startupProbe": _tcp_probe(period_s=10, failures=60),
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": _tcp_probe(period_s=10, failures=6),
        # The Service stops sending new requests before the router is told to stop.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "securityContext": NO_ESCALATION,
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }
    spec = {
        "terminationGracePeriodSeconds": _grace_s(config),
        "securityContext": NON_ROOT,
        "containers": [container],
        "volumes": [_models_volume()],
        # Routers on different nodes where there are several: a node lost leaves one serving.
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": labels("router")},
            }
        ],
    }
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0}}
    return _deployment("router", config.router.replicas, spec, strategy)


# KubeRay mode --------------------------------------------------------------------------------


def kuberay(config: ClusterFile) -> list[dict]:
    gpus = any(pool.uses_gpus for pool in _pools(config).values())
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": {
            "metadata": {"labels": labels("router")},
            "spec": {
                "securityContext": NON_ROOT,
                "containers": [
                    {
                        "name": "ray-head",
                        "image": _image(gpus),
                        "env": SECRET_ENV + REDIS_ENV + API_KEYS_ENV + CACHE_ENV,
                        "ports": [
                            {"name": "gcs", "containerPort": 6379},
                            {"name": "dashboard", "containerPort": 8265},
                            {"name": "client", "containerPort": 10001},
                            {"name": "http", "containerPort": ROUTER_PORT},
                        ],
                        "resources": {
                            "requests": {"cpu": "2", "memory": "8Gi"},
                            "limits": {"memory": "8Gi"},
                        },
                        "securityContext": NO_ESCALATION,
                        "volumeMounts": [
                            {"name": "models", "mountPath": "/models"},
                            {"name": "cluster-file", "mountPath": "/etc/pdserve"},
                        ],
                    }
                ],
                "volumes": [
                    _models_volume(),
                    {"name": "cluster-file", "configMap": {"name": "pdserve-cluster-file"}},
                ],
            },
        },
    }
    groups = []
    for role, pool in _pools(config).items():
        resource = "num-gpus" if pool.uses_gpus else "num-cpus"
        spec = {
            "securityContext": NON_ROOT,
            "containers": [
                {
                    "name": "ray-worker",
                    "image": _image(pool.uses_gpus),
                    "env": SECRET_ENV + REDIS_ENV + CACHE_ENV,
                    "resources": pool_resources(config, pool),
                    "securityContext": NO_ESCALATION,
                    "volumeMounts": [
                        {"name": "models", "mountPath": "/models"},
                        {"name": "dshm", "mountPath": "/dev/shm"},
                    ],
                }
            ],
            "volumes": _volumes(pool.uses_gpus),
        }
        if pool.uses_gpus:
            spec["tolerations"] = GPU_TOLERATIONS
        groups.append(
            {
                "groupName": role,
                "replicas": pool.replicas,
                "minReplicas": pool.replicas,
                "maxReplicas": pool.replicas,
                # One pdserve worker per pod: the pod offers exactly its TP group.
                "rayStartParams": {resource: str(pool.tensor_parallel_size)},
                "template": {"metadata": {"labels": labels(f"{role}-node")}, "spec": spec},
            }
        )
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": metadata(RAY_CLUSTER, "ray"),
        "spec": {
            "rayVersion": importlib.metadata.version("ray"),
            "headGroupSpec": head,
            "workerGroupSpecs": groups,
        },
    }
    return [_cluster_file_map(config), cluster, _up_job(config, gpus)]


def _cluster_file_map(config: ClusterFile) -> dict:
    """The cluster file `pdserve up` reads on the head: the registry is the base's Redis, the
    router listens on every address of the head pod."""
    document = config.model_copy(
        update={
            "registry": config.registry.model_copy(
                update={"url": _registry_url(config), "embedded": False}
            ),
            "router": config.router.model_copy(update={"host": "0.0.0.0", "port": ROUTER_PORT}),
        }
    ).model_dump(mode="json", exclude_defaults=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata("pdserve-cluster-file", "ray"),
        "data": {"cluster.yaml": _yaml(document)},
    }


def _up_job(config: ClusterFile, gpus: bool) -> dict:
    """`pdserve up` as a Ray job: its driver runs on the head, where the cluster file is
    mounted, and the router actor it starts stays there (the router Service's pod)."""
    command = ["ray", "job", "submit", "--address", f"http://{RAY_CLUSTER}-head-svc:8265", "--"]
    command += ["pdserve", "up", "-f", "/etc/pdserve/cluster.yaml", "--address", "auto"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata("pdserve-up", "up"),
        "spec": {
            "backoffLimit": 3,
            "template": {
                "metadata": {"labels": labels("up")},
                "spec": {
                    "restartPolicy": "Never",
                    "securityContext": NON_ROOT,
                    "containers": [
                        {
                            "name": "up",
                            "image": _image(gpus),
                            "command": command,
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "512Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            "securityContext": NO_ESCALATION,
                        }
                    ],
                },
            },
        },
    }


# Shared pieces -------------------------------------------------------------------------------


def pool_resources(config: ClusterFile, pool: PoolSection) -> dict:
    """A worker pod's requests and limits: its TP group's GPUs (or CPU ranks), and memory."""
    tp = pool.tensor_parallel_size
    if pool.uses_gpus:
        return _gpu_resources(tp)
    memory = f"{math.ceil(config.kv_cache_gib(pool)) + CPU_WORKER_OVERHEAD_GIB}Gi"
    return {"requests": {"cpu": str(tp), "memory": memory}, "limits": {"memory": memory}}


def _gpu_resources(gpus: int) -> dict:
    memory = f"{HOST_GIB_PER_GPU * gpus}Gi"
    return {
        "requests": {"cpu": str(CPUS_PER_GPU * gpus), "memory": memory, "nvidia.com/gpu": gpus},
        "limits": {"memory": memory, "nvidia.com/gpu": gpus},
    }


def _spans_nodes(pool: PoolSection, gpus_per_node: int) -> bool:
    return pool.uses_gpus and pool.tensor_parallel_size > gpus_per_node


def _pools(config: ClusterFile) -> dict[str, PoolSection]:
    return {role: pool for role, pool in config.pools().items() if pool.replicas}


def _receives_kv(role: str) -> bool:
    """Decode workers, and flex workers (any of them may be given decode)."""
    return role in (Role.DECODE, Role.FLEX)


def _registry_url(config: ClusterFile) -> str:
    """The file's Redis, or the base's when it asks for an embedded one (one host only)."""
    return config.registry.url or REDIS_URL


def _grace_s(config: ClusterFile) -> int:
    """No request outlives its deadline, so draining never needs longer than that."""
    return math.ceil(config.router.request_timeout_s) + DRAIN_MARGIN_S


def _image(gpu: bool) -> str:
    """The image of deploy/docker/Dockerfile's target; `images:` in a kustomization (or
    `kustomize edit set image pdserve=REGISTRY/pdserve`) points it at your registry."""
    return f"pdserve:{importlib.metadata.version('pdserve')}-{'gpu' if gpu else 'cpu'}"


def _deployment(component: str, replicas: int, pod_spec: dict, strategy: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(f"pdserve-{component}", component),
        "spec": {
            "replicas": replicas,
            "strategy": strategy,
            "selector": {"matchLabels": labels(component)},
            "template": {"metadata": {"labels": labels(component)}, "spec": pod_spec},
        },
    }


def _pdb(component: str, max_unavailable: int) -> dict:
    """Voluntary disruptions (node drains) take one pod of a pool at a time."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(f"pdserve-{component}", component),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": labels(component)},
        },
    }


def _grpc_probe(service: str, period_s: int, failures: int) -> dict:
    return {
        "grpc": {"port": GRPC_PORT, "service": service},
        "periodSeconds": period_s,
        "failureThreshold": failures,
    }


def _tcp_probe(period_s: int, failures: int) -> dict:
    return {"tcpSocket": {"port": "http"}, "periodSeconds": period_s, "failureThreshold": failures}


def _models_volume() -> dict:
    return {"name": "models", "persistentVolumeClaim": {"claimName": "pdserve-models"}}


def _volumes(gpu: bool) -> list[dict]:
    """The model cache, and /dev/shm as memory (the container default is 64 MiB)."""
    shm = {"medium": "Memory", "sizeLimit": SHM["gpu" if gpu else "cpu"]}
    return [_models_volume(), {"name": "dshm", "emptyDir": shm}]


def _one_node_model_cache() -> dict:
    """A CPU cluster (a smoke test on one node) takes the model cache ReadWriteOnce."""
    patch = [
        {"op": "replace", "path": "/spec/accessModes", "value": ["ReadWriteOnce"]},
        {"op": "replace", "path": "/spec/resources/requests/storage", "value": "10Gi"},
    ]
    return {
        "target": {"kind": "PersistentVolumeClaim", "name": "pdserve-models"},
        "patch": _yaml(patch),
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a patch, the cluster file) as readable literal blocks."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def _yaml_stream(documents: list) -> str:
    return "---\n".join(_yaml(document) for document in documents)


def _yaml(document) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=100)
