"""What every pdserve deployment holds, whichever way its workers run: the namespace, the Redis
registry the workers join and the router follows, the router's Service, and the NetworkPolicies
that keep other pods away from Redis and the workers. The cluster secret, the Redis password and
the API keys are Secrets the user creates (deploy/README.md), never rendered.

Redis holds the pool registry and the routers' shared state. Membership refills within a
heartbeat after a restart (every worker rewrites its record each heartbeat, with a time to live of
two); the routers write their shared state back from their own views. So no volume.
"""

from pdserve.cluster.k8s_objects import NO_ESCALATION, PART_OF, labels, metadata

REDIS_IMAGE = "redis:7.4.2-alpine"
REDIS_PORT = 6379
REDIS_PASSWORD = {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}}
PROMETHEUS_NAMESPACE = "monitoring"  # where kube-prometheus-stack runs Prometheus


REDIS_UID = 10999


def base_objects(namespace: str, pod_security: str, router_port: int, metrics_port: int) -> list:
    """`pod_security`: the Pod Security level the namespace enforces ("" when only warned of)."""
    return [
        _namespace(namespace, pod_security),
        *_redis(),
        _router_service(router_port),
        *network_policies(router_port, metrics_port),
    ]


def _namespace(name: str, enforce: str) -> dict:
    admission = "pod-security.kubernetes.io"
    security = {f"{admission}/warn": "restricted", f"{admission}/audit": "restricted"}
    if enforce:
        security[f"{admission}/enforce"] = enforce
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {**PART_OF, **security}},
    }


def _redis() -> list[dict]:
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["--save", "", "--appendonly", "no", "--requirepass", "$(REDISCLI_AUTH)"],
        # The server's password, and redis-cli's (the readiness probe).
        "env": [{"name": "REDISCLI_AUTH", "valueFrom": REDIS_PASSWORD}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10},
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": {**NO_ESCALATION, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata("redis", "registry"),
        "spec": {
            "selector": labels("registry"),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}],
        },
    }
    stateful_set = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata("redis", "registry"),
        "spec": {
            "serviceName": "redis",
            "replicas": 1,
            "selector": {"matchLabels": labels("registry")},
            "template": {
                "metadata": {"labels": labels("registry")},
                "spec": {
                    # Not the image's redis user (999, a uid hosts use): its data is the
                    # emptyDir below, which fsGroup makes writable.
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": REDIS_UID,
                        "runAsGroup": REDIS_UID,
                        "fsGroup": REDIS_UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    return [service, stateful_set]


def _router_service(router_port: int) -> dict:
    """The OpenAI API. Its pods: the router Deployment (deployments mode) or the Ray head, where
    `pdserve up` runs the router (kuberay mode); both carry the router component label."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata("pdserve-router", "router"),
        "spec": {
            "selector": labels("router"),
            "ports": [{"name": "http", "port": router_port, "targetPort": router_port}],
        },
    }


def network_policies(router_port: int, metrics_port: int) -> list[dict]:
    """Who may reach pdserve's pods (ingress; egress stays open). Policies add up:
    - pdserve pods reach each other on any port: the registry (Redis), the workers' gRPC, KV and
      metrics ports, and in kuberay mode Ray's and NCCL's ports, which are chosen at run time;
    - anyone reaches the router's OpenAI port (the Gateway, port-forward, your clients);
    - Prometheus (namespace `monitoring`) scrapes the workers' and the router's metrics.
    Nothing else reaches Redis or a worker: a pod outside pdserve can neither register a worker
    nor call one. A pod labelled part-of=pdserve in the namespace is trusted: who may create pods
    there is the boundary (and the cluster secret guards every worker call and KV stream). Needs
    a CNI that enforces NetworkPolicy (Calico, Cilium, ...)."""
    everyone = {"matchLabels": PART_OF}
    members = {"podSelector": everyone, "policyTypes": ["Ingress"]}
    prometheus = {"matchLabels": {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}}
    return [
        network_policy(
            "pdserve-internal", {**members, "ingress": [{"from": [{"podSelector": everyone}]}]}
        ),
        network_policy(
            "pdserve-router",
            {
                "podSelector": {"matchLabels": labels("router")},
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"port": router_port, "protocol": "TCP"}]}],
            },
        ),
        network_policy(
            "pdserve-metrics",
            {
                **members,
                "ingress": [
                    {
                        "from": [{"namespaceSelector": prometheus}],
                        "ports": [
                            {"port": metrics_port, "protocol": "TCP"},
                            {"port": router_port, "protocol": "TCP"},
                        ],
                    }
                ],
            },
        ),
    ]


def network_policy(name: str, spec: dict) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": dict(PART_OF)},
        "spec": spec,
    }
