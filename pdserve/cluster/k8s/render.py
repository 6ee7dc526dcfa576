"""Kubernetes manifests from a cluster file and the deployment's options: what `pdserve k8s
render` writes. The output stands alone (a GitOps repository can hold it as it is): pdserve.yaml
holds the namespace, Redis, the router Service and the NetworkPolicies (base.py), the model
cache and the Job that fills it (model_cache.py), and the mode's objects; `kubectl apply -k
DIR`, or `kubectl apply -f DIR/pdserve.yaml`, applies it.

Two modes, the same pools:
- deployments: one Deployment per pool running `pdserve worker --role ROLE --registry ...`, and
  a router Deployment following the registry. Changing the P:D ratio is `kubectl scale
  deployment/pdserve-decode --replicas=N`. A worker pod drains in its preStop hook
  (pdserve/worker/drain.py) before SIGTERM, within terminationGracePeriodSeconds.
- kuberay: a RayJob whose cluster's worker groups are the pools (one pdserve worker per pod: a
  pod offers its tensor-parallel group's GPUs) and whose entrypoint is `pdserve up`, so Ray places
  TP groups exactly as on bare metal; the router runs on the head (behind the router Service).
  KubeRay submits the job only once its cluster is ready, and the entrypoint keeps running while
  the cluster serves: a lost head fails the job, and KubeRay retries it on a new cluster.

Beside it, kustomizations of their own for objects whose CRDs a cluster may lack: gateway/
(gateway.py), monitoring/ (monitoring.py) and, in deployments mode, autoscaling/
(autoscaling.py). A flex cluster file renders one pool, `flex`.

Every number in the output comes from the cluster file, the options or a constant here, so the
committed overlays are this module's output with the default options (a test compares).
"""

import importlib.metadata
import json
import math
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from pdserve.cluster.k8s.autoscaling import scaled_object
from pdserve.cluster.k8s.base import REDIS_PORT, Flow, Tracing, base_objects, network_policy
from pdserve.cluster.k8s.fabric import fabric_affinity, with_rdma
from pdserve.cluster.k8s.gateway import gateway_objects
from pdserve.cluster.k8s.leader_worker import (
    RANK_SUFFIX,
    data_parallel_set,
    leader_worker_set,
    ray_follower_container,
)
from pdserve.cluster.k8s.model_cache import (
    PROBE_PERIOD_S,
    cache_env,
    fetch_egress,
    fetch_job,
    model_cache_claim,
    models_mount,
    models_volume,
    start_budget,
    wait_for_model,
)
from pdserve.cluster.k8s.monitoring import monitoring_objects
from pdserve.cluster.k8s.objects import NO_ESCALATION, POD_SECURITY, labels, metadata
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.scheduling import gpu_placement
from pdserve.cluster.k8s.tls import HEALTH_PORT, certificate, with_tls
from pdserve.core.kinds import Role
from pdserve.protocol.data_parallel import kv_receivers
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import ClusterFile, PoolSection

ROUTER_PORT = 8000
GRPC_PORT = 50051
METRICS_PORT = 9400
KV_PORT = 50100  # decode: tensor-parallel rank r receives on KV_PORT + r
KV_POOL_ADDRESS = "@pdserve-kv-pool"  # the store beside a worker, in its pod (an abstract socket)
KV_POOL_CONTAINER = "kv-pool"
MODES = ("deployments", "kuberay")
RAY_DASHBOARD_PORT = 8265
RAY_JOB_RETRIES = 3  # new clusters after a failed `pdserve up` or a lost head
RAY_NODE_SUFFIX = "-node"  # kuberay mode: a pool's Ray worker pods, component <role>-node
SUBMITTER = "ray-submitter"
REGISTRY = "registry"  # Redis's component (base.py)
OTLP_PORT = 4317  # an OTLP/gRPC collector's port when its URL names none

# Pod sizes. CPU: a SmolLM2-class worker used 1.3 GiB beside its KV cache (measured).
CPU_WORKER_OVERHEAD_GIB = 3
SHM = {"cpu": "1Gi", "gpu": "16Gi"}  # vLLM's TP message queues and NCCL use /dev/shm
DRAIN_MARGIN_S = 30  # beyond the longest request, for the drain's grace and the stop itself
ROUTER_START_S = 600  # the router reads the tokenizer from the filled cache

SECRET_ENV = [
    {
        "name": "PDSERVE_CLUSTER_SECRET",
        "valueFrom": {"secretKeyRef": {"name": "pdserve-cluster-secret", "key": "secret"}},
    }
]
# Required: a router listening beyond loopback without a key refuses to start (security review
# M7), where an optional Secret missing or misnamed published an open API. Admin keys (the
# /pdserve/ routes) and operator keys (priority, path) are optional: without any, nobody has
# those rights.
API_KEYS_ENV = [
    {
        "name": "PDSERVE_API_KEYS",
        "valueFrom": {"secretKeyRef": {"name": "pdserve-api-keys", "key": "keys"}},
    },
    *(
        {
            "name": name,
            "valueFrom": {
                "secretKeyRef": {"name": "pdserve-api-keys", "key": key, "optional": True}
            },
        }
        for name, key in (
            ("PDSERVE_OPERATOR_API_KEYS", "operator-keys"),
            ("PDSERVE_ADMIN_API_KEYS", "admin-keys"),
        )
    ),
]
REDIS_ENV = [  # router/shared/state.py and the registry authenticate with it
    {
        "name": "PDSERVE_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}},
    }
]
LOG_ENV = [{"name": "PDSERVE_LOG_FORMAT", "value": "json"}]
POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


def render(config: ClusterFile, mode: str, options: RenderOptions | None = None) -> dict[str, str]:
    """The output's files (path -> text) for `config` in `mode`; a pool whose TP group needs
    more than `options.gpus_per_node` GPUs spans nodes (deployments mode only); a data-parallel
    group spans its workers' nodes, each worker's ranks on one."""
    options = options or RenderOptions()
    gpus_per_node = options.gpus_per_node
    for role, pool in _pools(config).items():
        if pool.data_parallel_size > 1 and pool.gpus_per_worker > gpus_per_node:
            raise ConfigError(
                f"{role}.data_parallel_size_local: a worker's {pool.data_parallel_ranks} ranks "
                f"of TP {pool.tensor_parallel_size} take {pool.gpus_per_worker} GPUs, more than "
                f"a node's {gpus_per_node}: give each worker fewer ranks"
            )
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
    gpus = any(pool.uses_gpus for pool in _pools(config).values())
    # KubeRay adds containers of its own to the Ray pods: the namespace warns of what is not
    # "restricted" there rather than refusing the pods.
    # RDMA's IPC_LOCK is beyond "restricted" and "baseline" alike (fabric.py).
    enforced = "restricted" if mode == "deployments" and options.rdma is None else ""
    flows = traffic(config, mode, gpus_per_node)
    objects = base_objects(
        options.namespace, enforced, ROUTER_PORT, METRICS_PORT, flows, tracing(config, flows)
    )
    objects.append(model_cache_claim(config, options, gpus))
    job = fetch_job(config, options)
    objects += [job, fetch_egress()] if job else []
    if options.tls_issuer:
        objects.append(certificate(options.tls_issuer, options.tls_secret))
    if mode == "deployments":
        objects += deployments(config, options)
    else:
        objects += kuberay(config, options)
    folders = {
        "": objects,
        "gateway": gateway_objects(ROUTER_PORT, options.namespace),
        "monitoring": monitoring_objects(options.release_label),
    }
    if mode == "deployments":
        folders["autoscaling"] = [
            scaled_object(
                role,
                pool.replicas,
                _spans_nodes(pool, gpus_per_node) or _data_parallel_over_nodes(pool),
                options.namespace,
                options.prometheus_url,
            )
            for role, pool in _pools(config).items()
        ]
    header = (
        f"# Rendered by `pdserve k8s render --mode {mode}` from the cluster file {config.name!r}:"
        "\n# edit the cluster file and render again rather than this file.\n"
    )
    files = {}
    for folder, contents in folders.items():
        name = f"{folder or 'pdserve'}.yaml"
        prefix = f"{folder}/" if folder else ""
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [name],
        }
        files[f"{prefix}kustomization.yaml"] = header + _yaml(kustomization)
        files[prefix + name] = header + _yaml_stream(_namespaced(contents, options.namespace))
    return files


def traffic(config: ClusterFile, mode: str, gpus_per_node: int) -> list[Flow]:
    """Who calls whom inside the namespace (base.network_policies admits exactly these).

    deployments: the router calls Redis and each pool's gRPC port; each worker, Redis. Prefill
    workers fetch from each other's KV pools (gRPC). A prefill worker pushes KV to a decode
    worker's KV ports, and with the nccl transport the decode side joins the group store the
    prefill side hosts on a port chosen at run time, and NCCL connects both ways: the two pools
    reach each other on any port; flex workers, each other. A LeaderWorkerSet's rank pods are a
    Ray cluster with their leader (any port) and send KV as their leader does. Nobody but the
    prefill side reaches a decode worker's KV ports.
    kuberay: Ray's pods (the head, where the router runs, and each pool's nodes) reach each other
    on any port (Ray's and NCCL's ports are chosen at run time) and Redis; KubeRay's submitter,
    the head's dashboard."""
    roles = list(_pools(config))
    if mode == "kuberay":
        ray = ["router", *(f"{role}{RAY_NODE_SUFFIX}" for role in roles)]
        flows = [Flow(source, target) for source in ray for target in ray]
        flows += [Flow(source, REGISTRY, (REDIS_PORT,)) for source in ray]
        return [*flows, Flow(SUBMITTER, "router", (RAY_DASHBOARD_PORT,))]
    flows = [Flow("router", REGISTRY, (REDIS_PORT,))]
    for role in roles:
        flows += [Flow("router", role, (GRPC_PORT,)), Flow(role, REGISTRY, (REDIS_PORT,))]
    groups = [role for role in roles if _data_parallel_over_nodes(config.pool(role))]
    flows += [Flow(role, role) for role in groups if role != Role.FLEX]
    if Role.FLEX in roles:
        flows.append(Flow(Role.FLEX, Role.FLEX))
    if Role.PREFILL in roles:
        senders = [Role.PREFILL.value]
        if _spans_nodes(config.pool(Role.PREFILL), gpus_per_node):
            senders.append(f"{Role.PREFILL}{RANK_SUFFIX}")
            group = [Role.PREFILL.value, senders[-1]]
            flows += [Flow(source, target) for source in group for target in group]
        elif Role.PREFILL not in groups:
            flows.append(Flow(Role.PREFILL, Role.PREFILL, (GRPC_PORT,)))  # their KV pools
        if Role.DECODE in roles:
            flows += [Flow(sender, Role.DECODE) for sender in senders]
            flows += [Flow(Role.DECODE, sender) for sender in senders]
    return [Flow(str(f.source), str(f.target), f.ports) for f in flows]


def tracing(config: ClusterFile, flows: list[Flow]) -> Tracing | None:
    """With the cluster file's `otlp_endpoint`, the processes that export traces (the router and
    the workers: every component in a flow but Redis, the submitter and the LWS ranks) reach the
    collector's port, wherever it runs."""
    if not config.otlp_endpoint:
        return None
    port = urlsplit(config.otlp_endpoint).port or OTLP_PORT
    skipped = (REGISTRY, SUBMITTER)
    components = {c for f in flows for c in (f.source, f.target) if c not in skipped}
    return Tracing(tuple(sorted(c for c in components if not c.endswith(RANK_SUFFIX))), port)


def default_out(cluster_file: Path, mode: str) -> Path:
    """k8s/overlays/<file name>/<mode> beside the cluster file's folder: deploy/k8s/overlays/...
    for deploy/clusters/<file>."""
    return cluster_file.resolve().parent.parent / "k8s" / "overlays" / cluster_file.stem / mode


def write(files: dict[str, str], out: Path) -> None:
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def _namespaced(objects: list[dict], namespace: str) -> list[dict]:
    for obj in objects:
        if obj["kind"] != "Namespace":
            name = obj["metadata"].pop("name")
            obj["metadata"] = {"name": name, "namespace": namespace, **obj["metadata"]}
    return objects


# Deployments mode ----------------------------------------------------------------------------


def deployments(config: ClusterFile, options: RenderOptions) -> list[dict]:
    objects = [router_deployment(config, options), _pdb("router", 1)]
    for role, pool in _pools(config).items():
        if _spans_nodes(pool, options.gpus_per_node):
            workers = multi_node_workers(config, role, pool, options)
        elif _data_parallel_over_nodes(pool):
            resources = pool_resources(config, role, pool, options)
            spec = worker_pod_spec(config, role, pool, resources, options)
            workers = data_parallel_set(role, pool.replicas, pool.workers_per_replica, spec)
        else:
            workers = worker_deployment(config, role, pool, options)
        objects += [workers, _pdb(role, 1)]
    return objects


def worker_deployment(
    config: ClusterFile, role: str, pool: PoolSection, options: RenderOptions
) -> dict:
    resources = pool_resources(config, role, pool, options)
    spec = worker_pod_spec(config, role, pool, resources, options)
    # Without spare GPUs a rolling update replaces one pod at a time; on CPU it adds one first.
    surge = (
        {"maxSurge": 0, "maxUnavailable": 1}
        if pool.uses_gpus
        else {"maxSurge": 1, "maxUnavailable": 0}
    )
    strategy = {"type": "RollingUpdate", "rollingUpdate": surge}
    return _deployment(role, pool.replicas, spec, strategy, config)


def multi_node_workers(
    config: ClusterFile, role: str, pool: PoolSection, options: RenderOptions
) -> dict:
    """A pool whose TP group is larger than a node: a LeaderWorkerSet of groups, one pod per
    node; the leader runs the pdserve worker on a Ray head, the others lend it their GPUs."""
    gpus_per_node = options.gpus_per_node
    resources = _gpu_resources(gpus_per_node, options)
    leader = worker_pod_spec(config, role, pool, resources, options)
    env = SECRET_ENV + cache_env() + LOG_ENV  # its ranks send KV (the secret), reach no Redis
    follower = {
        **POD_SECURITY,
        "containers": [
            ray_follower_container(options.worker_image(True), env, resources, gpus_per_node)
        ],
        "volumes": _volumes(True),
        **gpu_placement(pool.gpu_type, options.node_selector, options.tolerations),
    }
    with_tls(follower, options.tls_secret)  # vLLM's ranks there send KV
    with_rdma(follower["containers"][0], options.rdma)
    nodes = pool.tensor_parallel_size // gpus_per_node
    return leader_worker_set(role, pool.replicas, nodes, leader, follower)


def worker_pod_spec(
    config: ClusterFile, role: str, pool: PoolSection, resources: dict, options: RenderOptions
) -> dict:
    settings = config.worker_settings(role, options.redis_url).model_copy(
        update={
            "host": "0.0.0.0",
            "port": GRPC_PORT,
            "metrics_port": METRICS_PORT,
            "kv_port": KV_PORT if _receives_kv(role) else 0,
            # Kubelet's gRPC probes speak no TLS: with it they ask a plaintext health port.
            "health_port": HEALTH_PORT if options.tls_secret else 0,
        }
    )
    pool_gib = kv_pool_gib(config, role, options)
    if pool_gib:
        settings = settings.model_copy(update={"kv_pool_address": KV_POOL_ADDRESS})
    ports = [
        {"name": "grpc", "containerPort": GRPC_PORT},
        {"name": "metrics", "containerPort": METRICS_PORT},
    ]
    if options.tls_secret:
        ports.append({"name": "health", "containerPort": HEALTH_PORT})
    probe_port = HEALTH_PORT if options.tls_secret else GRPC_PORT
    if _receives_kv(role):
        ports += [
            {"name": f"kv-{rank}", "containerPort": KV_PORT + rank}
            for rank in range(kv_receivers(pool.data_parallel_ranks, pool.tensor_parallel_size))
        ]
    image = options.worker_image(pool.uses_gpus)
    container = {
        "name": "worker",
        "image": image,
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
        "env": POD_ENV + SECRET_ENV + REDIS_ENV + cache_env() + LOG_ENV,
        "ports": ports,
        "resources": resources,
        # Readiness: SERVING only with the engine READY; liveness: the process answers and its
        # engine has not failed (pdserve/worker/grpc_health.py). The start-up probe covers
        # reading the weights and the engine's start, sized from the model.
        "startupProbe": _grpc_probe(
            probe_port, "liveness", PROBE_PERIOD_S, start_budget(config).startup_failures
        ),
        "readinessProbe": _grpc_probe(probe_port, "", period_s=5, failures=2),
        "livenessProbe": _grpc_probe(probe_port, "liveness", period_s=10, failures=6),
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
        "volumeMounts": [models_mount(), {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    spec = {
        "terminationGracePeriodSeconds": _grace_s(config),
        **POD_SECURITY,
        "initContainers": wait_for_model(config, image),
        "containers": [container, kv_pool_container(image, pool_gib)] if pool_gib else [container],
        "volumes": _volumes(pool.uses_gpus),
    }
    if pool.uses_gpus:
        spec.update(gpu_placement(pool.gpu_type, options.node_selector, options.tolerations))
        with_rdma(container, options.rdma)
    spec.update(fabric_affinity(role, options.fabric_key))
    return _without_empty(with_tls(spec, options.tls_secret))


def router_deployment(config: ClusterFile, options: RenderOptions) -> dict:
    settings = config.router_settings(options.redis_url).model_copy(
        update={"host": "0.0.0.0", "port": ROUTER_PORT}
    )
    image = options.image("router")
    container = {
        "name": "router",
        "image": image,
        "args": [
            "router",
            "--settings-json",
            json.dumps(settings.model_dump(mode="json", exclude_defaults=True)),
        ],
        "env": SECRET_ENV + REDIS_ENV + API_KEYS_ENV + cache_env() + LOG_ENV,
        "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
        "resources": {
            "requests": {"cpu": options.router_cpu, "memory": options.router_memory},
            "limits": {"memory": options.router_memory},
        },
        # /health is 503 while no decode worker is up: it gates traffic, never restarts.
        "startupProbe": _tcp_probe(PROBE_PERIOD_S, math.ceil(ROUTER_START_S / PROBE_PERIOD_S)),
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": _tcp_probe(period_s=10, failures=6),
        # The Service stops sending new requests before the router is told to stop.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "securityContext": NO_ESCALATION,
        "volumeMounts": [models_mount()],
    }
    spec = {
        "terminationGracePeriodSeconds": _grace_s(config),
        **POD_SECURITY,
        "initContainers": wait_for_model(config, image),
        "containers": [container],
        "volumes": [models_volume()],
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
    spec = _without_empty(with_tls(spec, options.tls_secret))
    return _deployment("router", config.router.replicas, spec, strategy, config)


# KubeRay mode --------------------------------------------------------------------------------


def kuberay(config: ClusterFile, options: RenderOptions) -> list[dict]:
    gpus = any(pool.uses_gpus for pool in _pools(config).values())
    image = options.worker_image(gpus)
    env = SECRET_ENV + REDIS_ENV + cache_env() + LOG_ENV
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": {
            "metadata": {"labels": labels("router")},
            "spec": _without_empty(
                with_tls(
                    {
                        **POD_SECURITY,
                        # The router and `pdserve up` run here: the model must be in the cache.
                        "initContainers": wait_for_model(config, image),
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": image,
                                "env": env + API_KEYS_ENV,
                                "ports": [
                                    {"name": "gcs", "containerPort": 6379},
                                    {"name": "dashboard", "containerPort": RAY_DASHBOARD_PORT},
                                    {"name": "client", "containerPort": 10001},
                                    {"name": "http", "containerPort": ROUTER_PORT},
                                ],
                                "resources": {
                                    "requests": {"cpu": "2", "memory": "8Gi"},
                                    "limits": {"memory": "8Gi"},
                                },
                                "securityContext": NO_ESCALATION,
                                "volumeMounts": [
                                    models_mount(),
                                    {"name": "cluster-file", "mountPath": "/etc/pdserve"},
                                ],
                            }
                        ],
                        "volumes": [
                            models_volume(),
                            {"name": "cluster-file", "configMap": {"name": "pdserve-cluster-file"}},
                        ],
                    },
                    options.tls_secret,
                )
            ),
        },
    }
    groups = []
    for role, pool in _pools(config).items():
        resource = "num-gpus" if pool.uses_gpus else "num-cpus"
        spec = {
            **POD_SECURITY,
            "containers": [
                {
                    "name": "ray-worker",
                    "image": options.worker_image(pool.uses_gpus),
                    "env": env,
                    "resources": pool_resources(config, role, pool, options),
                    "securityContext": NO_ESCALATION,
                    "volumeMounts": [models_mount(), {"name": "dshm", "mountPath": "/dev/shm"}],
                }
            ],
            "volumes": _volumes(pool.uses_gpus),
        }
        if pool.uses_gpus:
            spec.update(gpu_placement(pool.gpu_type, options.node_selector, options.tolerations))
            with_rdma(spec["containers"][0], options.rdma)
        spec.update(fabric_affinity(role, options.fabric_key, suffix=RAY_NODE_SUFFIX))
        with_tls(spec, options.tls_secret)
        groups.append(
            {
                "groupName": role,
                # One pdserve worker per pod: the pod offers exactly its TP group (a
                # data-parallel worker: its node's ranks), a group's workers a pod each.
                "replicas": pool.replicas * pool.workers_per_replica,
                "minReplicas": pool.replicas * pool.workers_per_replica,
                "maxReplicas": pool.replicas * pool.workers_per_replica,
                "rayStartParams": {resource: str(pool.gpus_per_worker)},
                "template": {
                    "metadata": {"labels": labels(f"{role}{RAY_NODE_SUFFIX}")},
                    "spec": spec,
                },
            }
        )
    up = ["pdserve", "up", "-f", "/etc/pdserve/cluster.yaml", "--address", "auto"]
    up += ["--join-timeout", str(start_budget(config).start_s)]
    # KubeRay's submitter pod (it runs `ray job submit` once the cluster is ready): ours, so that
    # it is a pdserve pod (the NetworkPolicies admit it to the dashboard) and non-root.
    submitter = {
        "metadata": {"labels": labels(SUBMITTER)},
        "spec": {
            "restartPolicy": "Never",
            **POD_SECURITY,
            "containers": [
                {
                    "name": "submitter",
                    "image": image,
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "512Mi"},
                        "limits": {"memory": "1Gi"},
                    },
                    "securityContext": NO_ESCALATION,
                }
            ],
        },
    }
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata("pdserve", "ray"),
        "spec": {
            # The driver stays while the cluster serves; it ends only with the head.
            "entrypoint": f"{shlex.join(up)} && exec sleep infinity",
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": submitter,
            "backoffLimit": RAY_JOB_RETRIES,
            # A failed job's cluster goes, GPUs and all; a retry starts a new one.
            "shutdownAfterJobFinishes": True,
            "rayClusterSpec": {
                "rayVersion": importlib.metadata.version("ray"),
                # The dashboard (job submission) asks for a token KubeRay makes and hands out.
                "authOptions": {"mode": "token"},
                "headGroupSpec": head,
                "workerGroupSpecs": groups,
            },
        },
    }
    # The KubeRay operator (any namespace) asks the head's dashboard how the job goes.
    operator = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
    }
    dashboard = network_policy(
        "pdserve-ray-dashboard",
        {
            "podSelector": {"matchLabels": labels("router")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [operator], "ports": [{"port": RAY_DASHBOARD_PORT, "protocol": "TCP"}]}
            ],
        },
    )
    return [_cluster_file_map(config, options), job, dashboard]


def _cluster_file_map(config: ClusterFile, options: RenderOptions) -> dict:
    """The cluster file `pdserve up` reads on the head: the registry is the rendered Redis, the
    router listens on every address of the head pod."""
    document = config.model_copy(
        update={
            "registry": config.registry.model_copy(
                update={"url": options.redis_url, "embedded": False}
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


# Shared pieces -------------------------------------------------------------------------------


def pool_resources(
    config: ClusterFile, role: str, pool: PoolSection, options: RenderOptions
) -> dict:
    """A worker pod's requests and limits: its TP group's GPUs (a data-parallel worker's: its
    ranks'), or CPU ranks, and memory, with its KV pool's (the worker writes the pool's blocks:
    their pages count as its memory)."""
    tp = pool.gpus_per_worker
    pool_gib = math.ceil(kv_pool_gib(config, role, options))
    if pool.uses_gpus:
        return _gpu_resources(tp, options, pool_gib)
    memory = f"{math.ceil(config.kv_cache_gib(pool)) + CPU_WORKER_OVERHEAD_GIB + pool_gib}Gi"
    return {"requests": {"cpu": str(tp), "memory": memory}, "limits": {"memory": memory}}


def kv_pool_gib(config: ClusterFile, role: str, options: RenderOptions) -> float:
    """The KV pool beside each worker of pool `role` (0: none; docs/kv-pool.md). None for a
    TP group across nodes: the ranks on the other pods could not reach the store."""
    wants = config.worker_settings(role, "").wants_kv_pool
    spans = _spans_nodes(config.pool(role), options.gpus_per_node)
    return config.kv_pool.gib if wants and not spans else 0.0


def kv_pool_container(image: str, gib: float) -> dict:
    """The worker's KV pool store (kv_transfer/pool/store.py), beside it in its pod: the pod's
    containers share its network namespace, so the worker reaches the store's abstract Unix
    socket, and the store checks that it runs as the same user. A restarted store is a new,
    empty pool; while it is down the worker computes what it would have loaded."""
    command = ["python", "-m", "kv_transfer.pool.store", "--address", KV_POOL_ADDRESS]
    probe = {"exec": {"command": [*command, "--probe"]}, "periodSeconds": 10, "timeoutSeconds": 5}
    return {
        "name": KV_POOL_CONTAINER,
        "image": image,
        "command": command,
        "args": ["--budget-bytes", str(int(gib * 2**30))],
        # Ready: it answers (the worker serves either way: without it, it computes everything).
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {
            "requests": {"cpu": "100m", "memory": "64Mi"},
            "limits": {"memory": "256Mi"},
        },
        "securityContext": NO_ESCALATION,
    }


def _gpu_resources(gpus: int, options: RenderOptions, extra_gib: int = 0) -> dict:
    memory = f"{options.memory_per_gpu_gib * gpus + extra_gib}Gi"
    return {
        "requests": {
            "cpu": str(options.cpus_per_gpu * gpus),
            "memory": memory,
            "nvidia.com/gpu": gpus,
        },
        "limits": {"memory": memory, "nvidia.com/gpu": gpus},
    }


def _spans_nodes(pool: PoolSection, gpus_per_node: int) -> bool:
    """A TP group larger than a node (its ranks beyond the leader's node lend GPUs by Ray)."""
    return pool.uses_gpus and pool.tensor_parallel_size > gpus_per_node


def _data_parallel_over_nodes(pool: PoolSection) -> bool:
    """A data-parallel group of several workers, one per node."""
    return pool.uses_gpus and pool.workers_per_replica > 1


def _pools(config: ClusterFile) -> dict[str, PoolSection]:
    return {role: pool for role, pool in config.pools().items() if pool.replicas}


def _receives_kv(role: str) -> bool:
    """Decode workers, and flex workers (any of them may be given decode)."""
    return role in (Role.DECODE, Role.FLEX)


def _grace_s(config: ClusterFile) -> int:
    """No request outlives its deadline, so draining never needs longer than that."""
    return math.ceil(config.router.request_timeout_s) + DRAIN_MARGIN_S


def _deployment(
    component: str, replicas: int, pod_spec: dict, strategy: dict, config: ClusterFile
) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(f"pdserve-{component}", component),
        "spec": {
            "replicas": replicas,
            # Its pods wait for the model's download, then load it: neither is a stalled rollout.
            "progressDeadlineSeconds": start_budget(config).progress_deadline_s,
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


def _grpc_probe(port: int, service: str, period_s: int, failures: int) -> dict:
    return {
        "grpc": {"port": port, "service": service},
        "periodSeconds": period_s,
        "failureThreshold": failures,
    }


def _tcp_probe(period_s: int, failures: int) -> dict:
    return {"tcpSocket": {"port": "http"}, "periodSeconds": period_s, "failureThreshold": failures}


def _volumes(gpu: bool) -> list[dict]:
    """The model cache, and /dev/shm as memory (the container default is 64 MiB)."""
    shm = {"medium": "Memory", "sizeLimit": SHM["gpu" if gpu else "cpu"]}
    return [models_volume(), {"name": "dshm", "emptyDir": shm}]


def _without_empty(spec: dict) -> dict:
    """A pod spec without the lists that came out empty (no init container for a folder)."""
    return {key: value for key, value in spec.items() if value != []}


class _Dumper(yaml.CSafeDumper):
    """Multi-line strings (the cluster file) as readable literal blocks; a part shared by several
    objects (a security context) written out in each, not as an alias. libyaml's emitter (PyYAML's
    wheels carry it): the Python one took seconds for a render's hundreds of objects."""

    def ignore_aliases(self, data) -> bool:
        return True


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
