"""`pdserve k8s render` for a real deployment, offline: the 70B cluster file rendered with a
namespace, an image registry, a storage class and a Hugging Face token Secret finds each in every
object that needs it, and every object still validates strictly; GPU pods go to their gpu_type's
nodes unless told otherwise; every pod passes Pod Security "restricted"; the model is fetched once,
before anything loads it, with probes and deadlines sized from its checkpoint; and the render
needs nothing from a source checkout."""

import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.cluster.k8s.model_cache import start_budget
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import MODES
from pdserve.cluster.k8s.scheduling import GPU_PRODUCT_LABEL, GPU_PRODUCTS
from pdserve.core.gpu_spec import GPU_PRESETS
from pdserve.settings.cluster_file import load_cluster_file
from tests.unit.k8s_rendering import (
    DEPLOY,
    OVERLAYS,
    SEVENTY_B,
    build,
    by_kind,
    main_container,
    pod_specs,
    rendered,
)
from tests.unit.k8s_validation import validate_strictly

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = RenderOptions(
    namespace="llm-prod",
    image_registry="registry.example.com/ml",
    image_tag="2026.8.1",
    storage_class="efs-rwx",
    hf_token_secret="hf-llama",
)
HF_TOKEN = {
    "name": "HF_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "hf-llama", "key": "token", "optional": False}},
}


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


@pytest.mark.parametrize("mode", MODES)
def test_the_70b_file_rendered_for_a_deployment_carries_its_choices_everywhere(tmp_path, mode):
    objects = rendered(tmp_path, mode, OPTIONS)
    validate_strictly(objects)
    (namespace,) = by_kind(objects, "Namespace")
    assert namespace == "llm-prod"
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "llm-prod", obj["metadata"]["name"]
    (claim,) = by_kind(objects, "PersistentVolumeClaim").values()
    assert claim["spec"]["storageClassName"] == "efs-rwx"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pods = dict(pod_specs(objects))
    pdserve_pods = {name: pod for name, pod in pods.items() if name not in ("redis", "pdserve-epp")}
    for name, pod in pdserve_pods.items():
        for container in containers(pod):
            assert container["image"].startswith("registry.example.com/ml/pdserve:2026.8.1-"), name
    # The fetch Job alone downloads, with the token; the engines and the tokenizer read the
    # filled cache with the hub offline, and never hold the token (review M11).
    (fetch,) = by_kind(objects, "Job").values()
    assert HF_TOKEN in main_container(fetch["spec"]["template"]["spec"])["env"]
    if mode == "deployments":
        loaders = [pods[f"pdserve-{role}"] for role in ("router", "prefill", "decode")]
    else:
        loaders = [pods[name] for name in ("ray-head", "ray-prefill", "ray-decode")]
    for pod in loaders:
        container = main_container(pod)
        assert HF_TOKEN not in container["env"], container["name"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"], container["name"]
    # The registry every process joins is this namespace's Redis, which the pods can reach.
    redis = "redis://redis.llm-prod.svc:6379/0"
    if mode == "deployments":
        for role in ("router", "prefill", "decode"):
            container = main_container(pods[f"pdserve-{role}"])
            settings = json.loads(container["args"][container["args"].index("--settings-json") + 1])
            assert settings["registry"] == redis
        for scaler in by_kind(objects, "ScaledObject").values():
            for trigger in scaler["spec"]["triggers"]:
                assert 'namespace="llm-prod"' in trigger["metadata"]["query"]
    else:
        assert (
            f"url: {redis}"
            in by_kind(objects, "ConfigMap")["pdserve-cluster-file"]["data"]["cluster.yaml"]
        )
    (epp,) = by_kind(objects, "RoleBinding").values()
    assert epp["subjects"][0]["namespace"] == "llm-prod"
    (picker,) = pods["pdserve-epp"]["containers"]
    assert picker["args"][picker["args"].index("--pool-namespace") + 1] == "llm-prod"
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        (monitor,) = by_kind(objects, kind).values()
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_gpu_pods_go_to_their_gpu_type_unless_told_otherwise(tmp_path):
    assert set(GPU_PRODUCTS) == set(GPU_PRESETS)  # a new preset needs its product label
    pods = dict(pod_specs(rendered(tmp_path / "a", "deployments", RenderOptions())))
    for role in ("prefill", "decode"):
        pod = pods[f"pdserve-{role}"]
        assert pod["nodeSelector"] == {GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    assert "nodeSelector" not in pods["pdserve-router"]
    out = tmp_path / "b"
    gke = ["--node-selector", "cloud.google.com/gke-accelerator=nvidia-h100-80gb"]
    taints = ["--toleration", "dedicated=llm:NoSchedule", "--toleration", "nvidia.com/gpu"]
    command = ["k8s", "render", "-f", str(SEVENTY_B), "--out", str(out), *gke, *taints]
    assert main(command) == 0
    pod = by_kind(build(out), "Deployment")["pdserve-decode"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists"},
    ]
    out = tmp_path / "c"
    assert (
        main(["k8s", "render", "-f", str(SEVENTY_B), "--out", str(out), "--node-selector", "none="])
        == 0
    )
    pod = by_kind(build(out), "Deployment")["pdserve-decode"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod


def test_a_bad_toleration_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["k8s", "render", "-f", str(SEVENTY_B), "--toleration", "key:Sometimes"])
    assert "NoSchedule" in capsys.readouterr().err


def test_every_flag_reaches_the_output(tmp_path):
    out = tmp_path / "out"
    flags = {
        "--namespace": "llm",
        "--image-registry": "r.example/x/",
        "--image-tag": "t1",
        "--storage-class": "nfs",
        "--model-cache-size": "900Gi",
        "--hf-token-secret": "hf",
        "--router-cpu": "3",
        "--router-memory": "6Gi",
        "--cpus-per-gpu": "4",
        "--memory-per-gpu-gib": "32",
        "--release-label": "prom",
        "--prometheus-url": "http://prom.obs.svc:9090",
    }
    command = ["k8s", "render", "-f", str(SEVENTY_B), "--out", str(out)]
    assert main(command + [item for pair in flags.items() for item in pair]) == 0
    objects = build(out) + build(out / "monitoring") + build(out / "autoscaling")
    (claim,) = by_kind(objects, "PersistentVolumeClaim").values()
    assert claim["spec"]["resources"]["requests"]["storage"] == "900Gi"
    deployments = by_kind(objects, "Deployment")
    (router,) = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"]
    assert router["image"] == "r.example/x/pdserve:t1-router"
    assert router["resources"]["requests"] == {"cpu": "3", "memory": "6Gi"}
    decode = main_container(deployments["pdserve-decode"]["spec"]["template"]["spec"])
    assert decode["resources"]["requests"]["cpu"] == "16"  # 4 GPUs
    assert decode["resources"]["limits"]["memory"] == "192Gi"  # and its KV pool's 64
    assert by_kind(objects, "PrometheusRule")["pdserve"]["metadata"]["labels"]["release"] == "prom"
    for scaler in by_kind(objects, "ScaledObject").values():
        assert (
            scaler["spec"]["triggers"][0]["metadata"]["serverAddress"] == flags["--prometheus-url"]
        )


def restricted_violations(pod: dict) -> list[str]:
    """What Pod Security "restricted" refuses, for the fields pdserve's pods set."""
    found = []
    security = pod.get("securityContext", {})
    if not security.get("runAsNonRoot"):
        found.append("runAsNonRoot")
    if security.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        found.append("seccompProfile")
    if any(key in pod for key in ("hostNetwork", "hostPID", "hostIPC")):
        found.append("host namespaces")
    if any("hostPath" in volume for volume in pod.get("volumes", [])):
        found.append("hostPath")
    for container in containers(pod):
        context = container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{container['name']}: allowPrivilegeEscalation")
        if context.get("capabilities", {}).get("drop") != ["ALL"]:
            found.append(f"{container['name']}: capabilities")
        if context.get("privileged") or context.get("runAsUser") == 0:
            found.append(f"{container['name']}: root")
    return found


def test_every_pod_of_every_output_passes_pod_security_restricted(tmp_path):
    for folder in sorted(OVERLAYS.glob("*/*")):
        objects = [obj for sub in (folder, folder / "gateway") for obj in build(sub)]
        for name, pod in pod_specs(objects):
            assert not restricted_violations(pod), (folder, name, restricted_violations(pod))
        (namespace,) = by_kind(objects, "Namespace").values()
        enforce = namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce")
        # KubeRay adds containers of its own to the Ray pods: warned of there, not refused.
        assert enforce == ("restricted" if folder.name == "deployments" else None)


def test_the_model_is_fetched_once_before_anything_loads_it(tmp_path):
    objects = rendered(tmp_path, "deployments", OPTIONS)
    (fetch,) = by_kind(objects, "Job").values()
    (fetcher,) = fetch["spec"]["template"]["spec"]["containers"]
    script = fetcher["command"][2]
    assert script.startswith("hf download meta-llama/Llama-3.1-70B-Instruct --exclude 'original/*'")
    marker = script.rsplit("touch ", 1)[1]
    pods = dict(pod_specs(objects))
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        (wait,) = pods[name]["initContainers"]
        assert f"until [ -e {marker} ]" in wait["command"][2], name
    # A cold 70B start (141 GB read, then the engine's start) is minutes: not a failure.
    budget = start_budget(load_cluster_file(SEVENTY_B))
    decode = by_kind(objects, "Deployment")["pdserve-decode"]["spec"]
    worker = main_container(decode["template"]["spec"])
    probe = worker["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= budget.start_s > 10 * 60
    assert decode["progressDeadlineSeconds"] >= budget.download_s + budget.start_s
    # ... and a small model keeps the floor, not less.
    small = start_budget(load_cluster_file(DEPLOY / "clusters/gpu-8b.yaml"))
    assert small.start_s == 600 and small.download_s < budget.download_s


def test_a_model_folder_is_not_fetched_and_nothing_waits_for_it(tmp_path):
    path = tmp_path / "folder.yaml"
    path.write_text(
        SEVENTY_B.read_text().replace("meta-llama/Llama-3.1-70B-Instruct", "/models/mine")
    )
    objects = rendered(tmp_path, "deployments", RenderOptions(), path)
    assert not by_kind(objects, "Job")
    assert all("initContainers" not in pod for _, pod in pod_specs(objects))


def test_render_needs_nothing_from_a_source_checkout():
    """What the render reads at run time is package data a wheel carries."""
    source = (ROOT / "pdserve/cluster/k8s").glob("*.py")
    assert not any(
        "deploy" in line and "Path(" in line for f in source for line in f.read_text().splitlines()
    )
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert any(fnmatch("alerts.yaml", pattern) for pattern in data["pdserve.cluster.k8s"])


def test_a_file_that_does_not_fit_its_gpus_is_not_rendered(tmp_path, capsys):
    """`k8s render` checks what `up` checks before anything starts (GPU review §1 row 6: a file
    that did not fit was rendered, to fail on the cluster): one TP=1 prefill worker holding all
    67.7 GiB of the 70B FP8 weights."""
    too_big = tmp_path / "too-big.yaml"
    too_big.write_text(
        json.dumps(
            {
                "model": {"path": "RedHatAI/Meta-Llama-3.1-70B-Instruct-FP8", "dtype": "bfloat16"},
                "engine": {"kv_cache_gib": 8},
                "prefill": {"replicas": 1, "tensor_parallel_size": 1, "gpu_type": "H100-SXM"},
                "decode": {"replicas": 1, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
            }
        )
    )
    out = tmp_path / "out"
    assert main(["k8s", "render", "-f", str(too_big), "--out", str(out)]) == 2
    assert "does not fit in GPU memory: prefill TP 1 on H100-SXM" in capsys.readouterr().err
    assert not out.exists()
