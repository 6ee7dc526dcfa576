"""What every pdserve Kubernetes object shares, whichever module renders it: the labels that
select pdserve's pods, and the pod security settings (Pod Security "restricted": non-root, no
privilege escalation, no capabilities, the runtime's seccomp profile; a uid above 10000, which no
host account has; no API token in pods that never call the API). The namespace is set on
every object once, where the render assembles them (pdserve/cluster/k8s/render.py)."""

PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
UID = 10001  # deploy/docker/Dockerfile's pdserve user
NON_ROOT = {
    "runAsNonRoot": True,
    "runAsUser": UID,
    "runAsGroup": UID,
    "fsGroup": UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# pdserve's pods: none calls the Kubernetes API (the endpoint picker, which does, is not one).
POD_SECURITY = {"securityContext": NON_ROOT, "automountServiceAccountToken": False}
NO_ESCALATION = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def labels(component: str) -> dict:
    return {**PART_OF, "app.kubernetes.io/component": component}


def metadata(name: str, component: str) -> dict:
    return {"name": name, "labels": labels(component)}
