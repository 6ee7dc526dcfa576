"""The Kubernetes tree, offline (no cluster here): the committed overlays are what `pdserve k8s
render` makes of deploy/clusters; `kubectl kustomize` builds each; every object validates (core
kinds with kubernetes-validate, strictly; custom resources against their CRD schemas); and the
pods ask for what the cluster file says (GPUs per worker = its tensor parallelism, replicas,
probes, drain)."""

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cli import main
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import (
    GRPC_PORT,
    KV_POOL_ADDRESS,
    KV_POOL_CONTAINER,
    KV_PORT,
    METRICS_PORT,
    render,
)
from pdserve.settings.cluster_file import load_cluster_file, parse_cluster
from tests.unit.k8s_rendering import (
    CLUSTER_FILES,
    DEPLOY,
    OVERLAY_DIRS,
    OVERLAYS,
    build,
    by_kind,
)
from tests.unit.k8s_validation import CRDS, crd_validator, unknown_fields, validate_custom

REDIS_URL = RenderOptions().redis_url
PROMETHEUS_OPERATOR = "monitoring.coreos.com/v1"


@pytest.fixture(scope="module")
def rayjob_schema() -> jsonschema.Draft7Validator:
    validator = crd_validator("ray.io_rayjobs.yaml", "v1")
    jsonschema.Draft7Validator.check_schema(validator.schema)  # once: it is the slow part
    return validator


def test_the_kubernetes_cluster_files_are_the_five_layouts():
    assert [path.stem for path in CLUSTER_FILES] == [
        "cpu-smoke",
        "deepseek-r1-wide-ep",
        "gpu-8b",
        "llama-3.1-70b-fp8-4p1d",
        "llama-3.1-70b-tp4-1p1d",
    ]


def test_committed_overlays_are_the_rendered_cluster_files():
    """Edit a cluster file, forget to render: this fails. No overlay without its file either."""
    for path, mode in OVERLAY_DIRS:
        out = OVERLAYS / path.stem / mode
        for name, text in render(load_cluster_file(path), mode).items():
            assert (out / name).read_text() == text, (
                f"{out / name} is stale: pdserve k8s render -f {path} --mode {mode}"
            )
    committed = {(folder.parent.name, folder.name) for folder in OVERLAYS.glob("*/*")}
    assert committed == {(path.stem, mode) for path, mode in OVERLAY_DIRS}


def test_render_command_writes_what_the_tree_holds(tmp_path):
    path = DEPLOY / "clusters/cpu-smoke.yaml"
    assert (
        main(["k8s", "render", "-f", str(path), "--mode", "kuberay", "--out", str(tmp_path)]) == 0
    )
    expected = render(load_cluster_file(path), "kuberay")
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*.yaml")}
    assert written == expected
    assert build(tmp_path) == build(OVERLAYS / "cpu-smoke/kuberay")


@pytest.mark.parametrize(("path", "mode"), OVERLAY_DIRS, ids=lambda v: getattr(v, "stem", v))
def test_overlay_builds_and_every_object_validates(path, mode, rayjob_schema):
    objects = build(OVERLAYS / path.stem / mode)
    for obj in objects:
        assert obj["metadata"].get("namespace", "pdserve") == "pdserve", obj
        if obj["kind"] == "RayJob":
            rayjob_schema.validate(obj)
            assert not unknown_fields(obj, rayjob_schema.schema)
        elif obj["kind"] in CRDS:  # a data-parallel group's LeaderWorkerSet
            validate_custom(obj, CRDS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
    config = load_cluster_file(path)
    if mode == "deployments":
        check_deployments(config, objects)
    else:
        check_kuberay(config, objects)


def check_deployments(config, objects: list[dict]) -> None:
    deployments = by_kind(objects, "Deployment")
    groups = by_kind(objects, "LeaderWorkerSet")
    assert set(by_kind(objects, "PodDisruptionBudget")) == set(deployments) | set(groups)
    assert set(by_kind(objects, "StatefulSet")) == {"redis"}
    grace = config.router.request_timeout_s + 30
    for role in ("prefill", "decode"):
        pool = config.pool(role)
        workers = worker_pods(objects, role)
        assert workers["spec"]["replicas"] == pool.replicas
        pod = workers["pod"]
        containers = {container["name"]: container for container in pod["containers"]}
        worker = containers.pop("worker")
        gpus = worker["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert gpus == (pool.gpus_per_worker if pool.uses_gpus else 0)
        assert worker["resources"]["requests"].get("nvidia.com/gpu", 0) == gpus
        settings = json.loads(worker["args"][worker["args"].index("--settings-json") + 1])
        assert settings["registry"] == REDIS_URL
        check_kv_pool(config, role, settings, containers)
        assert settings["engine"].get("tensor_parallel_size", 1) == pool.tensor_parallel_size
        assert settings["engine"].get("data_parallel_size", 1) == pool.data_parallel_size
        assert worker["readinessProbe"]["grpc"] == {"port": GRPC_PORT, "service": ""}
        assert worker["livenessProbe"]["grpc"] == {"port": GRPC_PORT, "service": "liveness"}
        assert worker["lifecycle"]["preStop"]["exec"]["command"][:3] == [
            "python",
            "-m",
            "pdserve.worker.drain",
        ]
        assert pod["terminationGracePeriodSeconds"] == grace
        ports = {port["containerPort"] for port in worker["ports"]}
        kv = {KV_PORT + rank for rank in range(pool.gpus_per_worker)}  # per DP rank's TP rank
        assert ports == {GRPC_PORT, METRICS_PORT} | (kv if role == "decode" else set())
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
    (router,) = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in router["env"] if "valueFrom" in e}
    assert keys["PDSERVE_CLUSTER_SECRET"]["name"] == "pdserve-cluster-secret"
    assert keys["PDSERVE_API_KEYS"] == {"name": "pdserve-api-keys", "key": "keys"}


def worker_pods(objects: list[dict], role: str) -> dict:
    """A pool's workers: its Deployment, or the LeaderWorkerSet of a data-parallel group over
    nodes, whose every pod is a worker (the others' node and node 0's address from the set)."""
    deployment = by_kind(objects, "Deployment").get(f"pdserve-{role}")
    if deployment is not None:
        return {"spec": deployment["spec"], "pod": deployment["spec"]["template"]["spec"]}
    group = by_kind(objects, "LeaderWorkerSet")[f"pdserve-{role}"]["spec"]
    templates = group["leaderWorkerTemplate"]
    leader, member = templates["leaderTemplate"]["spec"], templates["workerTemplate"]["spec"]
    leader_args = next(c for c in leader["containers"] if c["name"] == "worker")["args"]
    member_args = next(c for c in member["containers"] if c["name"] == "worker")["args"]
    assert member_args == leader_args + [
        "--data-parallel-node",
        "$(LWS_WORKER_INDEX)",
        "--data-parallel-address",
        "$(LWS_LEADER_ADDRESS)",
    ]
    return {"spec": group, "pod": leader}


def check_kv_pool(config, role: str, settings: dict, sidecars: dict[str, dict]) -> None:
    """A worker whose TP group fits a node has its KV pool's store beside it, at the address
    it is given, with the cluster file's budget; one spanning nodes has none."""
    pool = config.pool(role)
    spans = pool.uses_gpus and pool.tensor_parallel_size > RenderOptions().gpus_per_node
    if not spans:
        store = sidecars.pop(KV_POOL_CONTAINER)
        address = store["command"][store["command"].index("--address") + 1]
        assert settings["kv_pool_address"] == address == KV_POOL_ADDRESS
        assert store["args"] == ["--budget-bytes", str(int(config.kv_pool.gib * 2**30))]
    else:
        assert "kv_pool_address" not in settings
    assert not sidecars


def check_kuberay(config, objects: list[dict]) -> None:
    (job,) = by_kind(objects, "RayJob").values()
    cluster = job["spec"]["rayClusterSpec"]
    groups = {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    assert set(groups) == {role for role in ("prefill", "decode") if config.pool(role).replicas}
    for role, group in groups.items():
        pool = config.pool(role)
        pods = pool.replicas * pool.workers_per_replica  # a data-parallel group's: one per node
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods
        (container,) = group["template"]["spec"]["containers"]
        if pool.uses_gpus:
            assert group["rayStartParams"] == {"num-gpus": str(pool.gpus_per_worker)}
            assert container["resources"]["limits"]["nvidia.com/gpu"] == pool.gpus_per_worker
        else:
            assert group["rayStartParams"] == {"num-cpus": str(pool.tensor_parallel_size)}
    file = yaml.safe_load(
        by_kind(objects, "ConfigMap")["pdserve-cluster-file"]["data"]["cluster.yaml"]
    )
    assert parse_cluster(file).registry.url == REDIS_URL
    # KubeRay submits once the cluster is ready; the driver stays while the cluster serves, so a
    # lost head fails the job and KubeRay retries it on a new cluster.
    assert job["spec"]["submissionMode"] == "K8sJobMode"
    assert job["spec"]["backoffLimit"] > 0 and job["spec"]["shutdownAfterJobFinishes"]
    up, stay = job["spec"]["entrypoint"].split(" && ")
    assert up.startswith("pdserve up -f /etc/pdserve/cluster.yaml --address auto --join-timeout")
    assert stay == "exec sleep infinity"
    assert not by_kind(objects, "RayCluster")


def test_monitoring_builds_with_a_monitor_per_component_and_the_dashboard():
    objects = build(OVERLAYS / "gpu-8b/deployments/monitoring")
    assert {(o["apiVersion"], o["kind"]) for o in objects} == {
        (PROMETHEUS_OPERATOR, "ServiceMonitor"),
        (PROMETHEUS_OPERATOR, "PodMonitor"),
        (PROMETHEUS_OPERATOR, "PrometheusRule"),
    }
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (obj,) = by_kind(objects, kind).values()
        validate_custom(obj, f"monitoring.coreos.com_{kind.lower()}s.yaml")
        # A default kube-prometheus-stack selects monitors and rules by its release's name.
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    (service_monitor,) = by_kind(objects, "ServiceMonitor").values()
    assert service_monitor["spec"]["endpoints"][0]["port"] == "http"
    (pod_monitor,) = by_kind(objects, "PodMonitor").values()
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    dashboard = by_kind(build(DEPLOY / "grafana"), "ConfigMap")["pdserve-dashboard"]
    kubernetes_validate.validate(dashboard, kubernetes_validate.latest_version(), strict=True)
    panels = json.loads(dashboard["data"]["pdserve-dashboard.json"])["panels"]
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"]) for panel in panels)
