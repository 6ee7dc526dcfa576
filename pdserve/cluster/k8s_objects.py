"""What every pdserve Kubernetes object shares, whichever module renders it: the labels that
select pdserve's pods, and the pod security settings (Pod Security "restricted": non-root, no
privilege escalation, no capabilities, the runtime's seccomp profile). The namespace is set on
every object once, where the render assembles them (pdserve/cluster/k8s_render.py)."""

PART_OF = {"app.kubernetes.io/part-of": "pdserve"}
NON_ROOT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
NO_ESCALATION = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def labels(component: str) -> dict:
    return {**PART_OF, "app.kubernetes.io/component": component}


def metadata(name: str, component: str) -> dict:
    return {"name": name, "labels": labels(component)}
