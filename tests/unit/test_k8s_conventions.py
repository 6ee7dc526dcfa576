"""What platform teams expect of the Kubernetes tree, offline: the Gateway API Inference Extension's
InferencePool and HTTPRoute in front of the routers, a KEDA ScaledObject per pool, alerts, a flex
cluster rendered; custom resources against their CRDs, and every metric a query or an alert names
exported by the code (a renamed metric fails here, not in a silent dashboard)."""

import ast
import importlib.util
import re
from pathlib import Path

import kubernetes_validate
import yaml
from prometheus_client import CollectorRegistry

from kv_transfer.pool.wire import GetStats, PoolStats
from pdserve.cli import main
from pdserve.cluster.k8s.gateway import EPP
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import KV_POOL_CONTAINER, ROUTER_PORT, render, write
from pdserve.settings.cluster_file import parse_cluster
from pdserve.worker.metrics_server import KvPoolCollector, WorkerMetrics
from router.metrics import RouterMetrics
from tests.unit.k8s_rendering import (
    OVERLAY_DIRS,
    OVERLAYS,
    build,
    by_kind,
    main_container,
    seventy_b,
)
from tests.unit.k8s_validation import validate_custom

LWS = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRDS = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
    "ScaledObject": "keda.sh_scaledobjects.yaml",
}
# What an endpoint picker reads from a model server (the model-server protocol of the Gateway API
# Inference Extension): queue, running requests, KV cache utilization.
MODEL_SERVER_PROTOCOL = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
}
METRIC_NAME = re.compile(r"(?<![\w:])(pdserve_\w+|vllm:[\w:]+|up(?=\{))")
FLEX = {
    "name": "flexy",
    "model": {"path": "HuggingFaceTB/SmolLM2-135M-Instruct"},
    "flex": {"replicas": 2, "kv_failure_policy": "fail"},
    "registry": {"url": "redis://redis.pdserve.svc:6379/0"},
}


def validate(objects: list[dict]) -> None:
    for obj in objects:
        assert obj["metadata"].get("namespace", "pdserve") == "pdserve", obj
        if obj["kind"] in CRDS:
            validate_custom(obj, CRDS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def vllm_metric_names() -> set[str]:
    """The series vLLM's PrometheusStatLogger registers (its `name="vllm:..."` arguments), read
    from its source so that no engine starts: a worker's /metrics serves them once its engine
    runs (tests/integration/test_worker_observability.py sees them there)."""
    spec = importlib.util.find_spec("vllm")
    source = Path(spec.origin).parent / "v1/metrics/loggers.py"
    return {
        node.value.value
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.keyword)
        and node.arg == "name"
        and isinstance(node.value, ast.Constant)
        and str(node.value.value).startswith("vllm:")
    }


class FakePoolStore:
    """Answers a worker's KV pool collector as an empty store would (its figures' names are
    what is checked here)."""

    def call(self, request: GetStats) -> PoolStats:
        assert request == GetStats()
        return PoolStats(None, 0, 0, 0, 0, 0, 0, 0, 0)


def pdserve_metric_names() -> set[str]:
    """Every series name the router and a worker (with a KV pool) export, as Prometheus stores
    them."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    registry = CollectorRegistry()
    WorkerMetrics(registry)
    registry.register(KvPoolCollector(FakePoolStore()))
    families = [*RouterMetrics().registry.collect(), *registry.collect()]
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def exported() -> set[str]:
    return vllm_metric_names() | pdserve_metric_names() | {"up"}


def test_workers_export_the_metric_names_of_the_model_server_protocol():
    assert MODEL_SERVER_PROTOCOL <= vllm_metric_names()


def test_the_inference_pool_fronts_the_routers_through_its_endpoint_picker():
    # Every overlay's gateway/ is the same apart from its header (nothing in it comes from the
    # cluster file): one build checks them all.
    folders = {OVERLAYS / path.stem / mode / "gateway" for path, mode in OVERLAY_DIRS}
    assert len({yaml_body(folder / "gateway.yaml") for folder in folders}) == 1
    objects = build(min(folders))
    validate(objects)
    (pool,) = by_kind(objects, "InferencePool").values()
    (route,) = by_kind(objects, "HTTPRoute").values()
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == EPP
    service = by_kind(objects, "Service")[EPP]
    assert service["spec"]["ports"][0]["port"] == picker["port"]["number"]
    (epp,) = by_kind(objects, "Deployment").values()
    assert epp["spec"]["template"]["metadata"]["labels"] == service["spec"]["selector"]
    # The pool's pods are the ones the router Service sends to, on the router's port.
    router_service = by_kind(build(min(folders).parent), "Service")["pdserve-router"]
    assert pool["spec"]["selector"]["matchLabels"] == router_service["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": ROUTER_PORT}]


def yaml_body(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(True) if not line.startswith("#"))


def test_each_pool_scales_on_its_own_pressure_signal():
    names = exported()
    for path, mode in OVERLAY_DIRS:
        if mode != "deployments":
            continue
        overlay = OVERLAYS / path.stem / mode
        objects = build(overlay / "autoscaling")
        validate(objects)
        built = build(overlay)
        workers = by_kind(built, "Deployment") | by_kind(built, "LeaderWorkerSet")
        scalers = by_kind(objects, "ScaledObject")
        assert set(scalers) == set(workers) - {"pdserve-router"}
        for name, scaler in scalers.items():
            spec = scaler["spec"]
            assert spec["scaleTargetRef"]["name"] == name
            assert spec["minReplicaCount"] == workers[name]["spec"]["replicas"]
            assert spec["maxReplicaCount"] > spec["minReplicaCount"]
            queries = [trigger["metadata"]["query"] for trigger in spec["triggers"]]
            used = {metric for query in queries for metric in METRIC_NAME.findall(query)}
            assert used <= names, used - names
            role = name.removeprefix("pdserve-")
            assert all(f'pool="{role}"' in query for query in queries)
            wanted = {"prefill": {"vllm:num_requests_waiting"}}.get(
                role, {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
            )
            assert used == wanted, role


def test_every_alert_names_a_metric_the_code_exports():
    (rule,) = by_kind(build(OVERLAYS / "gpu-8b/deployments/monitoring"), "PrometheusRule").values()
    alerts = [alert for group in rule["spec"]["groups"] for alert in group["rules"]]
    names = exported()
    for alert in alerts:
        used = set(METRIC_NAME.findall(alert["expr"]))
        assert used and used <= names, (alert["alert"], used - names)
    assert {alert["alert"] for alert in alerts} >= {
        "PdserveWorkerDown",
        "PdserveKvIntegrityFailures",
        "PdserveKvTransferFailures",
        "PdserveRejecting",
        "PdserveQueueWait",
        "PdserveMigrations",
    }


def test_a_flex_cluster_renders_one_pool_that_receives_kv_and_scales_on_both_signals(tmp_path):
    config = parse_cluster(FLEX)
    out = tmp_path / "deployments"
    write(render(config, "deployments"), out)
    objects = build(out)
    validate(objects)
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {"pdserve-router", "pdserve-flex"}
    flex = deployments["pdserve-flex"]
    assert flex["spec"]["replicas"] == 2
    worker = main_container(flex["spec"]["template"]["spec"])
    assert worker["args"][:3] == ["worker", "--role", "flex"]
    # its kv_failure_policy fail keeps it out of the KV pool (a pool miss would end a request)
    assert [c["name"] for c in flex["spec"]["template"]["spec"]["containers"]] == ["worker"]
    assert "kv-0" in {port["name"] for port in worker["ports"]}
    (scaler,) = by_kind(build(out / "autoscaling"), "ScaledObject").values()
    assert len(scaler["spec"]["triggers"]) == 3  # prefill's queue, decode's queue and KV usage


def test_render_command_takes_a_flex_cluster_file(tmp_path):
    path = tmp_path / "flexy.yaml"
    path.write_text(yaml.safe_dump(FLEX))
    out = tmp_path / "kuberay"
    assert main(["k8s", "render", "-f", str(path), "--mode", "kuberay", "--out", str(out)]) == 0
    (job,) = by_kind(build(out), "RayJob").values()
    groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert [group["groupName"] for group in groups] == ["flex"]


def test_a_prefill_group_larger_than_a_node_is_a_leader_worker_set(tmp_path):
    out = tmp_path / "deployments"
    options = RenderOptions(gpus_per_node=4)
    write(render(parse_cluster(seventy_b(8, 4)), "deployments", options), out)
    objects = build(out)
    validate_custom(by_kind(objects, "LeaderWorkerSet")["pdserve-prefill"], LWS)
    validate([obj for obj in objects if obj["kind"] != "LeaderWorkerSet"])
    assert set(by_kind(objects, "Deployment")) == {"pdserve-router", "pdserve-decode"}
    group = by_kind(objects, "LeaderWorkerSet")["pdserve-prefill"]["spec"]
    assert group["replicas"] == 1 and group["leaderWorkerTemplate"]["size"] == 2
    (leader,) = group["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    (rank,) = group["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    for container in (leader, rank):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    start_head, run_worker = leader["command"][2].split(" && ")
    assert start_head.startswith("ray start --head") and run_worker.startswith(
        "exec pdserve worker"
    )
    assert "--role prefill" in run_worker and "$(POD_IP)" in run_worker
    assert "--address=$(LWS_LEADER_ADDRESS):6379" in rank["command"]
    (scaler,) = [s for s in by_kind(build(out / "autoscaling"), "ScaledObject").values()
                 if s["spec"]["scaleTargetRef"].get("kind") == "LeaderWorkerSet"]  # fmt: skip
    assert scaler["spec"]["scaleTargetRef"]["name"] == "pdserve-prefill"


def test_a_decode_group_larger_than_a_node_is_refused_by_name(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(seventy_b(4, 8)))
    command = ["k8s", "render", "-f", str(path), "--gpus-per-node", "4", "--out", str(tmp_path)]
    assert main(command) == 2
    assert not (tmp_path / "pdserve.yaml").exists()


# Who may reach whom (the NetworkPolicies, ingress and egress): tests/unit/test_k8s_trust.py.


def test_several_routers_share_an_authenticated_redis_and_one_may_be_drained():
    objects = build(OVERLAYS / "gpu-8b/deployments")
    router = by_kind(objects, "Deployment")["pdserve-router"]
    assert router["spec"]["replicas"] >= 2
    (budget,) = [
        pdb
        for pdb in by_kind(objects, "PodDisruptionBudget").values()
        if pdb["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    ]
    assert budget["spec"]["maxUnavailable"] < router["spec"]["replicas"]  # a drain leaves one
    (redis,) = by_kind(objects, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"]
    password = {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}}
    assert "--requirepass" in redis["args"] and "--protected-mode" not in redis["args"]
    assert {"name": "REDISCLI_AUTH", "valueFrom": password} in redis["env"]
    pdserve_containers = [
        container
        for obj in by_kind(objects, "Deployment").values()
        if obj["metadata"]["name"].startswith("pdserve-")
        for container in obj["spec"]["template"]["spec"]["containers"]
        if container["name"] != KV_POOL_CONTAINER  # a worker's KV pool store reaches no Redis
    ]
    assert len(pdserve_containers) >= 3  # the router and both pools
    for container in pdserve_containers:
        assert {"name": "PDSERVE_REDIS_PASSWORD", "valueFrom": password} in container["env"]
