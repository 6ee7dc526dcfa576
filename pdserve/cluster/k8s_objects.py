"""What every pdserve Kubernetes object shares, whichever module renders it: the namespace, the
labels that select pdserve's pods, and the pod security settings."""

NAMESPACE = "pdserve"
PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
NON_ROOT = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
NO_ESCALATION = {"allowPrivilegeEscalation": False}


def labels(component: str) -> dict:
    return {**PART_OF, "app.kubernetes.io/component": component}


def metadata(name: str, component: str) -> dict:
    return {"name": name, "namespace": NAMESPACE, "labels": labels(component)}
