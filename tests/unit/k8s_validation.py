"""Validating rendered Kubernetes objects offline, as an API server would: core kinds with
kubernetes-validate, strictly; custom resources against their CRD schemas from ../shared/schemas,
including the fields a CRD lacks (the API server would drop them silently)."""

import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

# kubernetes-validate reads and parses a kind's schema and the ~1 MB of shared definitions on
# every call (most of the k8s tests' time): parse each file once. Nothing changes the parsed
# schemas (jsonschema and referencing only read them).
kubernetes_validate.utils.schema_contents = functools.cache(
    kubernetes_validate.utils.schema_contents
)

SCHEMAS = Path(__file__).resolve().parents[3] / "shared/schemas"
CRDS = {
    "RayJob": "ray.io_rayjobs.yaml",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
    "ScaledObject": "keda.sh_scaledobjects.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}


@functools.cache
def crd_validator(file: str, version: str) -> jsonschema.Draft7Validator:
    """A custom resource's schema from ../shared/schemas (its README says where each is from)."""
    path = SCHEMAS / file
    if not path.is_file():
        pytest.skip(f"the CRD schema is not at {path}")
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(served["schema"]["openAPIV3Schema"])


def validate_custom(obj: dict, file: str) -> None:
    """Valid against its CRD, and no field the CRD lacks (the API server would drop it)."""
    validator = crd_validator(file, obj["apiVersion"].rsplit("/", 1)[1])
    validator.validate(obj)
    assert not unknown_fields(obj, validator.schema), obj["metadata"]["name"]


def validate_strictly(objects: list[dict]) -> None:
    for obj in objects:
        if obj["kind"] in CRDS:
            validate_custom(obj, CRDS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    """Fields the CRD does not define (jsonschema lets them through: the CRD has no
    additionalProperties: false, but the API server prunes them silently)."""
    if isinstance(obj, list):
        return [
            bad
            for i, item in enumerate(obj)
            for bad in unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")
        ]
    if not isinstance(obj, dict) or "properties" not in schema:
        return []
    found = []
    for key, value in obj.items():
        if key in schema["properties"]:
            found += unknown_fields(value, schema["properties"][key], f"{path}.{key}")
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            found.append(f"{path}.{key}")
    return found
