"""`pdserve k8s render --tls-secret` (and `--tls-issuer`), offline: every container that runs
pdserve (routers, workers, Ray's head and workers, the LeaderWorkerSet's ranks) mounts the Secret
as the files pdserve's TLS folder holds and points PDSERVE_TLS_DIR at it; workers' probes ask the
plaintext health port their settings open; cert-manager's Certificate validates against its CRD;
without the flags nothing changes."""

import json

import pytest

from pdserve.cli import main
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import GRPC_PORT, MODES, render, write
from pdserve.cluster.k8s.tls import FILES, HEALTH_PORT, MOUNT
from pdserve.settings import tls
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import parse_cluster
from tests.unit.k8s_rendering import (
    SEVENTY_B,
    build,
    by_kind,
    main_container,
    pod_specs,
    rendered,
    seventy_b,
)
from tests.unit.k8s_validation import validate_custom, validate_strictly

WITH_TLS = RenderOptions(tls_secret="cluster-tls")
EXPECTED_PODS = {
    "deployments": {"pdserve-router", "pdserve-prefill", "pdserve-decode"},
    "kuberay": {"ray-head", "ray-prefill", "ray-decode"},
}
CERTIFICATE_CRD = "cert-manager.io_certificates.yaml"


def pdserve_pods(objects: list[dict]):
    """The pods running pdserve's image, but for the two that call no member: the model fetch
    Job's and KubeRay's job submitter."""
    for name, pod in pod_specs(objects):
        runs_pdserve = any(c["image"].startswith("pdserve:") for c in pod["containers"])
        if runs_pdserve and name != "ray-submitter" and not name.startswith("pdserve-model-fetch"):
            yield name, pod


def uses_the_tls_folder(pod: dict, secret: str) -> bool:
    (volume,) = [v for v in pod["volumes"] if "secret" in v and v["name"] == "tls"]
    files = {item["key"]: item["path"] for item in volume["secret"]["items"]}
    # the key readable by root and the pod's group (fsGroup: pdserve's) only (review L2)
    assert volume["secret"]["defaultMode"] == 0o440
    assert all("mode" not in item for item in volume["secret"]["items"])
    mounted = all(
        {"name": "tls", "mountPath": MOUNT, "readOnly": True} in container["volumeMounts"]
        and {"name": tls.TLS_DIR_ENV, "value": MOUNT} in container["env"]
        for container in pod["containers"]
    )
    return volume["secret"]["secretName"] == secret and files == FILES and mounted


def test_the_mounted_files_are_the_ones_pdserve_reads():
    assert sorted(FILES.values()) == sorted(tls.FILES)


@pytest.mark.parametrize("mode", MODES)
def test_every_pdserve_container_mounts_the_secret_as_its_tls_folder(tmp_path, mode):
    objects = rendered(tmp_path, mode, WITH_TLS)
    validate_strictly(objects)
    pods = dict(pdserve_pods(objects))
    assert set(pods) == EXPECTED_PODS[mode]
    for name, pod in pods.items():
        assert uses_the_tls_folder(pod, "cluster-tls"), name


def test_workers_are_probed_on_the_plaintext_health_port_they_open(tmp_path):
    objects = rendered(tmp_path, "deployments", WITH_TLS)
    deployments = by_kind(objects, "Deployment")
    for role in ("prefill", "decode"):
        worker = main_container(deployments[f"pdserve-{role}"]["spec"]["template"]["spec"])
        settings = json.loads(worker["args"][worker["args"].index("--settings-json") + 1])
        assert settings["health_port"] == HEALTH_PORT
        assert {"name": "health", "containerPort": HEALTH_PORT} in worker["ports"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert worker[probe]["grpc"]["port"] == HEALTH_PORT, probe


def test_a_leader_worker_sets_ranks_mount_it_too(tmp_path):
    """vLLM's ranks on the other nodes of a TP group send KV: they need the folder as well."""
    out = tmp_path / "deployments"
    options = RenderOptions(gpus_per_node=4, tls_secret="cluster-tls")
    write(render(parse_cluster(seventy_b(8, 4)), "deployments", options), out)
    group = by_kind(build(out), "LeaderWorkerSet")["pdserve-prefill"]["spec"]
    for template in ("leaderTemplate", "workerTemplate"):
        assert uses_the_tls_folder(group["leaderWorkerTemplate"][template]["spec"], "cluster-tls")


def test_without_tls_nothing_mounts_it_and_probes_ask_the_grpc_port(tmp_path):
    objects = rendered(tmp_path, "deployments", RenderOptions())
    for name, pod in pod_specs(objects):
        assert not [v for v in pod.get("volumes", []) if v["name"] == "tls"], name
    for deployment in by_kind(objects, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert tls.TLS_DIR_ENV not in {e["name"] for e in container.get("env", [])}
            if "startupProbe" in container and "grpc" in container["startupProbe"]:
                assert container["startupProbe"]["grpc"]["port"] == GRPC_PORT


def test_an_issuer_renders_cert_managers_certificate_for_the_secret(tmp_path):
    out = tmp_path / "out"
    command = ["k8s", "render", "-f", str(SEVENTY_B), "--out", str(out)]
    assert main(command + ["--tls-issuer", "ClusterIssuer/cluster-ca"]) == 0
    objects = build(out)
    (certificate,) = by_kind(objects, "Certificate").values()
    validate_custom(certificate, CERTIFICATE_CRD)
    spec = certificate["spec"]
    assert spec["dnsNames"] == [tls.TARGET_NAME]
    assert spec["issuerRef"] == {
        "group": "cert-manager.io",
        "kind": "ClusterIssuer",
        "name": "cluster-ca",
    }
    assert {"server auth", "client auth"} <= set(spec["usages"])
    for name, pod in pdserve_pods(objects):
        assert uses_the_tls_folder(pod, spec["secretName"]), name


def test_a_bad_issuer_is_refused(capsys):
    with pytest.raises(ConfigError, match="ClusterIssuer/NAME"):
        render(
            parse_cluster(seventy_b(4, 4)),
            "deployments",
            RenderOptions(tls_secret="s", tls_issuer="cluster-ca"),
        )
    command = ["k8s", "render", "-f", str(SEVENTY_B), "--out", "/nonexistent"]
    assert main(command + ["--tls-issuer", "Secret/x"]) == 2
    assert "refused" in capsys.readouterr().err
