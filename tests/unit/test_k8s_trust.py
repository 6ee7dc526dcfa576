"""Who may reach whom in a rendered cluster, and who holds which credential (review M11, and C1's
LeaderWorkerSet): the NetworkPolicies are evaluated here, ingress and egress, as an enforcing CNI
applies them; trust goes by component, so the endpoint picker (a third-party image) and the model
fetch Job (it downloads from the internet) reach neither Redis nor a worker; a decode worker's KV
ports admit the prefill side only; egress is denied but for DNS and what pdserve's processes
call; the hub token is the fetch Job's alone; a LeaderWorkerSet's Ray cluster runs token auth."""

import ipaddress
import json

import pytest
import yaml

from pdserve.cluster.k8s.gateway import EPP, EPP_GRPC_PORT
from pdserve.cluster.k8s.leader_worker import RAY_TOKEN_SECRET
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import (
    GRPC_PORT,
    KV_PORT,
    METRICS_PORT,
    MODES,
    RAY_DASHBOARD_PORT,
    ROUTER_PORT,
    render,
)
from pdserve.settings.cluster_file import load_cluster_file, parse_cluster
from tests.unit.k8s_rendering import DEPLOY, by_kind, load_all, seventy_b

NAMESPACE = "pdserve"
REDIS = 6379
RAY_GCS = 6379  # on the Ray head (kuberay) or a LeaderWorkerSet's leader
NCCL = 41234  # a port NCCL or the nccl transport's group store picks at run time
METADATA = ("ip", "169.254.169.254")  # the cloud's metadata service, port 80
SOMEWHERE = ("ip", "203.0.113.7")  # an address on the internet
DNS = ("ip", "10.96.0.10")
API_SERVER = ("ip", "10.0.0.1")
COMPONENT = "app.kubernetes.io/component"
PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
OPTIONS = RenderOptions(hf_token_secret="hf-llama")


def objects_of(config, mode: str, options: RenderOptions = OPTIONS) -> list[dict]:
    """Every object of the render (pdserve.yaml and the folders beside it), as rendered."""
    files = render(config, mode, options)
    return [
        doc
        for name, text in files.items()
        if not name.endswith("kustomization.yaml")
        for doc in load_all(text)
    ]


def pods(objects: list[dict]) -> dict[str, tuple[dict, dict]]:
    """name -> (labels, pod spec) of every pod an object makes (Ray's and LWS's groups too)."""
    found = {}
    for obj in objects:
        spec = obj.get("spec", {})
        if "template" in spec:
            template = spec["template"]
            found[obj["metadata"]["name"]] = (template["metadata"]["labels"], template["spec"])
        if cluster := spec.get("rayClusterSpec"):
            head = cluster["headGroupSpec"]["template"]
            found["ray-head"] = (head["metadata"]["labels"], head["spec"])
            for group in cluster["workerGroupSpecs"]:
                template = group["template"]
                found[f"ray-{group['groupName']}"] = (
                    template["metadata"]["labels"],
                    template["spec"],
                )
            submitter = spec["submitterPodTemplate"]
            found["ray-submitter"] = (submitter["metadata"]["labels"], submitter["spec"])
        if group := spec.get("leaderWorkerTemplate"):
            for key, name in (("leaderTemplate", "leader"), ("workerTemplate", "rank")):
                template = group[key]
                found[name] = (template["metadata"]["labels"], template["spec"])
    return found


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, and matchExpressions with In) against labels."""
    for expression in selector.get("matchExpressions", ()):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def peer_matches(peer: dict, endpoint: tuple) -> bool:
    """A rule's peer against an endpoint: ("pod", namespace, labels) or ("ip", address). An
    ipBlock is taken to match pods' addresses as well (some CNIs do)."""
    if "ipBlock" in peer:
        if endpoint[0] == "pod":
            return True
        address = ipaddress.ip_address(endpoint[1])
        block = peer["ipBlock"]
        inside = lambda cidr: address in ipaddress.ip_network(cidr)  # noqa: E731
        return inside(block["cidr"]) and not any(map(inside, block.get("except", ())))
    if endpoint[0] != "pod":
        return False
    _, namespace, labels = endpoint
    namespaces = peer.get("namespaceSelector")
    in_namespace = (
        selects(namespaces, {"kubernetes.io/metadata.name": namespace})
        if namespaces is not None
        else namespace == NAMESPACE
    )
    return in_namespace and selects(peer.get("podSelector", {}), labels)


def allows(
    policies: list[dict], pod: dict, direction: str, other: tuple, port: int, protocol: str
) -> bool:
    """Whether the policies selecting `pod` (of the namespace) let it take this connection in
    `direction` ("Ingress" from `other`, "Egress" to it): yes when none selects it for that
    direction; else some selecting policy's rule must name the peer and the port."""
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    chosen = [
        p["spec"]
        for p in policies
        if direction in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod)
    ]
    return not chosen or any(
        (not rule.get(peers) or any(peer_matches(peer, other) for peer in rule[peers]))
        and (
            not rule.get("ports")
            or any(
                p["port"] == port and p.get("protocol", "TCP") == protocol for p in rule["ports"]
            )
        )
        for spec in chosen
        for rule in spec.get(key, ())
    )


def reaches(policies, source: tuple, target: tuple, port: int, protocol: str = "TCP") -> bool:
    """A connection from `source` to `target` (each ("pod", namespace, labels) or ("ip", a)):
    the source's egress (a pod of the namespace) and the target's ingress must both allow it."""
    if source[0] == "pod" and source[1] == NAMESPACE:
        if not allows(policies, source[2], "Egress", target, port, protocol):
            return False
    if target[0] == "pod" and target[1] == NAMESPACE:
        return allows(policies, target[2], "Ingress", source, port, protocol)
    return True


def policies_of(objects: list[dict]) -> list[dict]:
    return list(by_kind(objects, "NetworkPolicy").values())


def pod(labels: dict, namespace: str = NAMESPACE) -> tuple:
    return ("pod", namespace, labels)


@pytest.fixture(scope="module")
def deployments():
    objects = objects_of(load_cluster_file(DEPLOY / "clusters/gpu-8b.yaml"), "deployments")
    return policies_of(objects), {name: pod(labels) for name, (labels, _) in pods(objects).items()}


@pytest.fixture(scope="module")
def leader_worker_set():
    """The 70B file with its prefill group across two 4-GPU nodes: a LeaderWorkerSet."""
    config = parse_cluster(seventy_b(8, 4))
    objects = objects_of(config, "deployments", RenderOptions(gpus_per_node=4))
    at = {name: pod(labels) for name, (labels, _) in pods(objects).items()}
    return objects, policies_of(objects), at


@pytest.fixture(scope="module")
def kuberay():
    objects = objects_of(load_cluster_file(DEPLOY / "clusters/gpu-8b.yaml"), "kuberay")
    return policies_of(objects), {name: pod(labels) for name, (labels, _) in pods(objects).items()}


def fetch_job(pods_by_name: dict) -> tuple:
    (name,) = [n for n in pods_by_name if n.startswith("pdserve-model-fetch-")]
    return pods_by_name[name]


def test_decode_kv_ports_admit_only_the_prefill_side(deployments):
    policies, at = deployments
    decode, prefill, router = at["pdserve-decode"], at["pdserve-prefill"], at["pdserve-router"]
    for port in (KV_PORT, NCCL):
        assert reaches(policies, prefill, decode, port)
        for other in (router, at[EPP], fetch_job(at), at["redis"], decode):
            assert not reaches(policies, other, decode, port), other
    assert reaches(policies, decode, prefill, NCCL)  # nccl: the prefill side hosts the store
    assert reaches(policies, router, decode, GRPC_PORT)
    assert reaches(policies, router, prefill, GRPC_PORT)
    assert reaches(policies, prefill, prefill, GRPC_PORT)  # a prefill worker's KV pool
    assert not reaches(policies, router, prefill, KV_PORT)


def test_redis_admits_the_routers_and_the_workers_only(deployments):
    policies, at = deployments
    redis = at["redis"]
    for client in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        assert reaches(policies, at[client], redis, REDIS), client
    for stranger in (at[EPP], fetch_job(at), pod({}), pod(PART_OF), pod(PART_OF, "default")):
        assert not reaches(policies, stranger, redis, REDIS), stranger


def test_the_endpoint_picker_and_the_fetch_job_reach_no_worker(deployments):
    policies, at = deployments
    outsiders = {"epp": at[EPP], "fetch": fetch_job(at), "labelled": pod(PART_OF)}
    for name, outsider in outsiders.items():
        for target in ("pdserve-prefill", "pdserve-decode"):
            for port in (GRPC_PORT, KV_PORT, METRICS_PORT, NCCL):
                assert not reaches(policies, outsider, at[target], port), (name, target, port)
    # The picker reads the routers (its pool's endpoints); the Gateway calls the picker.
    assert reaches(policies, at[EPP], at["pdserve-router"], ROUTER_PORT)
    gateway = pod({"app": "envoy"}, "gateway-system")
    assert reaches(policies, gateway, at[EPP], EPP_GRPC_PORT)
    assert not reaches(policies, gateway, at["pdserve-prefill"], GRPC_PORT)
    prometheus = pod({"app.kubernetes.io/name": "prometheus"}, "monitoring")
    assert reaches(policies, prometheus, at["pdserve-decode"], METRICS_PORT)
    assert not reaches(policies, prometheus, at["pdserve-decode"], GRPC_PORT)
    assert not reaches(policies, prometheus, at["redis"], REDIS)


def test_egress_is_denied_but_dns_and_what_each_pod_calls(deployments):
    policies, at = deployments
    for name, source in at.items():
        assert reaches(policies, source, DNS, 53, "UDP"), name
        assert not reaches(policies, source, METADATA, 80), name
        if name not in (EPP,) and not name.startswith("pdserve-model-fetch-"):
            assert not reaches(policies, source, SOMEWHERE, 443), name
    # The fetch Job downloads from anywhere but the metadata service (and the rest link-local).
    assert reaches(policies, fetch_job(at), SOMEWHERE, 443)
    assert not reaches(policies, fetch_job(at), ("ip", "169.254.10.1"), 443)
    # The picker asks the Kubernetes API.
    assert reaches(policies, at[EPP], API_SERVER, 6443)
    assert reaches(policies, at[EPP], API_SERVER, 443)


def test_a_collector_of_traces_is_reached_by_the_processes_that_trace():
    document = yaml.safe_load((DEPLOY / "clusters/gpu-8b.yaml").read_text())
    document["otlp_endpoint"] = "http://otel-collector.observability:4317"
    objects = objects_of(parse_cluster(document), "deployments")
    policies = policies_of(objects)
    at = {name: pod(labels) for name, (labels, _) in pods(objects).items()}
    collector = ("ip", "10.1.2.3")
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        assert reaches(policies, at[name], collector, 4317), name
        assert not reaches(policies, at[name], collector, 4318), name
    assert not reaches(policies, at["redis"], collector, 4317)


def test_a_leader_worker_set_is_one_ray_cluster_under_token_auth(leader_worker_set):
    objects, policies, at = leader_worker_set
    leader, rank = at["leader"], at["rank"]
    decode, router = at["pdserve-decode"], at["pdserve-router"]
    for a, b in ((leader, rank), (rank, leader), (rank, rank)):
        assert reaches(policies, a, b, NCCL) and reaches(policies, a, b, RAY_GCS)
    assert reaches(policies, rank, decode, KV_PORT)  # its ranks send KV as the leader's do
    assert reaches(policies, decode, rank, NCCL)
    assert reaches(policies, router, leader, GRPC_PORT)
    for outsider in (router, at[EPP], fetch_job(at), pod(PART_OF)):
        assert not reaches(policies, outsider, leader, RAY_GCS), outsider
        assert not reaches(policies, outsider, rank, RAY_GCS), outsider
    assert not reaches(policies, rank, at["redis"], REDIS)

    by_name = pods(objects)
    token = {"secretKeyRef": {"name": RAY_TOKEN_SECRET, "key": "token"}}
    for name in ("leader", "rank"):
        (container,) = by_name[name][1]["containers"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["RAY_AUTH_MODE"] == "token", name
        assert env["RAY_AUTH_TOKEN"] == token, name
    (leader_container,) = by_name["leader"][1]["containers"]
    start_head = leader_container["command"][2].split(" && ")[0]
    assert "--include-dashboard=false" in start_head  # no dashboard, nothing beside the GCS
    (rank_container,) = by_name["rank"][1]["containers"]
    assert "PDSERVE_REDIS_PASSWORD" not in {e["name"] for e in rank_container["env"]}


def test_ray_pods_reach_each_other_and_nothing_else_reaches_ray(kuberay):
    policies, at = kuberay
    ray = [at["ray-head"], at["ray-prefill"], at["ray-decode"]]
    for a in ray:
        assert reaches(policies, a, at["redis"], REDIS)
        for b in ray:
            assert reaches(policies, a, b, RAY_GCS) and reaches(policies, a, b, NCCL)
    submitter = at["ray-submitter"]
    assert reaches(policies, submitter, at["ray-head"], RAY_DASHBOARD_PORT)
    assert not reaches(policies, submitter, at["ray-head"], RAY_GCS)
    assert not reaches(policies, submitter, at["redis"], REDIS)
    operator = pod({"app.kubernetes.io/name": "kuberay-operator"}, "ray-system")
    assert reaches(policies, operator, at["ray-head"], RAY_DASHBOARD_PORT)
    for outsider in (at[EPP], fetch_job(at), pod(PART_OF)):
        for target in ray:
            assert not reaches(policies, outsider, target, RAY_GCS)
        assert not reaches(policies, outsider, at["redis"], REDIS)
    assert reaches(policies, pod({}, "default"), at["ray-head"], ROUTER_PORT)


@pytest.mark.parametrize("mode", MODES)
def test_only_the_fetch_job_holds_the_hub_token(mode):
    config = load_cluster_file(DEPLOY / "clusters/llama-3.1-70b-tp4-1p1d.yaml")
    found = pods(objects_of(config, mode))
    secret = {"name": "hf-llama", "key": "token", "optional": False}
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}}
    for name, (_, spec) in found.items():
        for container in spec.get("initContainers", []) + spec["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            if name.startswith("pdserve-model-fetch-"):
                assert token in container["env"] and "HF_HUB_OFFLINE" not in names
            else:
                assert "HF_TOKEN" not in names, (name, container["name"])
    loaders = ["pdserve-router", "pdserve-prefill", "pdserve-decode"]
    if mode == "kuberay":
        loaders = ["ray-head", "ray-prefill", "ray-decode"]
    for name in loaders:  # they read the filled cache: the hub is off (their egress is denied)
        env = found[name][1]["containers"][0]["env"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in env, name


def test_the_committed_overlays_carry_the_policies():
    """What the overlays hold is render's output (test_k8s_manifests): here, that the old blanket
    trust of every part-of pod is gone from each."""
    for path in sorted((DEPLOY / "k8s/overlays").glob("*/*/pdserve.yaml")):
        objects = load_all(path.read_text())
        names = set(by_kind(objects, "NetworkPolicy"))
        assert "pdserve-internal" not in names and "pdserve-default-deny" in names, path
        deny = by_kind(objects, "NetworkPolicy")["pdserve-default-deny"]["spec"]
        assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}, path
        assert json.dumps(objects).count('"HF_TOKEN"') == 0  # rendered without a token Secret


@pytest.mark.parametrize("mode", ["deployments", "kuberay"])
def test_every_router_needs_the_api_key_secret(mode):
    """Review M7: the routers listen beyond loopback, where a router without a key refuses to
    start; the keys' Secret is required (an optional one, missing or misnamed, served an open
    API), the operator's and admin's keys in it are not."""
    objects = objects_of(load_cluster_file(DEPLOY / "clusters/gpu-8b.yaml"), mode)
    keyed = [
        {
            e["name"]: e["valueFrom"].get("secretKeyRef")
            for e in c.get("env", [])
            if "valueFrom" in e
        }
        for _, spec in pods(objects).values()
        for c in spec["containers"]
    ]
    keyed = [refs for refs in keyed if "PDSERVE_API_KEYS" in refs]
    assert keyed  # the router's container (kuberay: the Ray pod it runs in)
    for refs in keyed:
        assert refs["PDSERVE_API_KEYS"] == {"name": "pdserve-api-keys", "key": "keys"}
        for name in ("PDSERVE_OPERATOR_API_KEYS", "PDSERVE_ADMIN_API_KEYS"):
            assert refs[name]["name"] == "pdserve-api-keys" and refs[name]["optional"]
