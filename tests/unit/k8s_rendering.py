"""The Kubernetes tree as the k8s tests read it, offline: the committed cluster files and
overlays, a cluster file rendered and built by `kubectl kustomize`, and the objects, containers
and pod specs a test picks out of it."""

import subprocess
from pathlib import Path

import yaml

from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import KV_POOL_CONTAINER, MODES, render, write
from pdserve.settings.cluster_file import load_cluster_file

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = DEPLOY / "k8s/overlays"
SEVENTY_B = DEPLOY / "clusters/llama-3.1-70b-tp4-1p1d.yaml"
# Cluster files with an embedded registry run on one host (`pdserve up` starts Redis there).
CLUSTER_FILES = sorted(
    path for path in (DEPLOY / "clusters").glob("*.yaml") if load_cluster_file(path).registry.url
)
OVERLAY_DIRS = [(path, mode) for path in CLUSTER_FILES for mode in MODES]


def build(folder: Path) -> list[dict]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return load_all(done.stdout)


def load_all(text: str) -> list[dict]:
    """Every document of a YAML stream, with libyaml's parser (the Python one took most of the
    k8s tests' seconds)."""
    return [doc for doc in yaml.load_all(text, Loader=yaml.CSafeLoader) if doc]


def rendered(tmp_path: Path, mode: str, options: RenderOptions, path: Path = SEVENTY_B) -> list:
    """Every object of the output: pdserve.yaml and each folder beside it, built by kustomize."""
    out = tmp_path / mode
    write(render(load_cluster_file(path), mode, options), out)
    folders = [out, *(folder for folder in out.iterdir() if folder.is_dir())]
    return [obj for folder in folders for obj in build(folder)]


def seventy_b(prefill_tp: int, decode_tp: int) -> dict:
    """The 70B cluster file's document with its pools' tensor parallelism changed."""
    document = yaml.safe_load(SEVENTY_B.read_text())
    document["prefill"]["tensor_parallel_size"] = prefill_tp
    document["decode"]["tensor_parallel_size"] = decode_tp
    return document


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == kind}


def main_container(pod: dict) -> dict:
    """A pod spec's pdserve process (a worker's pod also runs its KV pool's store)."""
    (main,) = [c for c in pod["containers"] if c["name"] != KV_POOL_CONTAINER]
    return main


def pod_specs(objects: list[dict]):
    """(object name, pod spec) of every pod an object makes, the Ray and LWS groups' included."""
    for obj in objects:
        spec = obj.get("spec", {})
        if "template" in spec:
            yield obj["metadata"]["name"], spec["template"]["spec"]
        cluster = spec.get("rayClusterSpec")
        if cluster:
            yield "ray-head", cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster["workerGroupSpecs"]:
                yield f"ray-{group['groupName']}", group["template"]["spec"]
            yield "ray-submitter", spec["submitterPodTemplate"]["spec"]
        group = spec.get("leaderWorkerTemplate")
        if group:
            yield "leader", group["leaderTemplate"]["spec"]
            yield "rank", group["workerTemplate"]["spec"]
