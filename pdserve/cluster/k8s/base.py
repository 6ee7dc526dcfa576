"""What every pdserve deployment holds, whichever way its workers run: the namespace, the Redis
registry the workers join and the router follows, the router's Service, and the NetworkPolicies
that say which pod may reach which (and nothing else). The cluster secret, the Redis password, the
API keys and the Ray token are Secrets the user creates (deploy/README.md), never rendered.

Redis holds the pool registry and the routers' shared state. Membership refills within a
heartbeat after a restart (every worker rewrites its record each heartbeat, with a time to live of
two); the routers write their shared state back from their own views. So no volume.
"""

from dataclasses import dataclass

from pdserve.cluster.k8s.objects import NO_ESCALATION, PART_OF, labels, metadata

REDIS_IMAGE = "redis:7.4.2-alpine"
REDIS_PORT = 6379
REDIS_PASSWORD = {"secretKeyRef": {"name": "pdserve-redis", "key": "password"}}
PROMETHEUS_NAMESPACE = "monitoring"  # where kube-prometheus-stack runs Prometheus


REDIS_UID = 10999


def base_objects(
    namespace: str,
    pod_security: str,
    router_port: int,
    metrics_port: int,
    flows: list["Flow"],
    tracing: "Tracing | None" = None,
) -> list:
    """`pod_security`: the Pod Security level the namespace enforces ("" when only warned of);
    `flows`: who reaches whom inside the namespace (Redis included), all else denied."""
    return [
        _namespace(namespace, pod_security),
        *_redis(),
        _router_service(router_port),
        *network_policies(router_port, metrics_port, flows, tracing),
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


@dataclass(frozen=True)
class Flow:
    """Pods of component `source` may open connections to pods of component `target` (in the
    namespace) on `ports` (empty: any port, for Ray's and NCCL's ports chosen at run time)."""

    source: str
    target: str
    ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Tracing:
    """Components that export OpenTelemetry traces, to a collector anywhere on `port`."""

    components: tuple[str, ...]
    port: int


def network_policies(
    router_port: int, metrics_port: int, flows: list[Flow], tracing: Tracing | None = None
) -> list[dict]:
    """Who may reach whom, ingress and egress (NetworkPolicies add up):
    - nothing, by default, for every pod of the namespace, in or out, but DNS;
    - anyone reaches the router's OpenAI port (the Gateway, port-forward, your clients);
    - Prometheus (namespace `monitoring`) scrapes the workers' and the router's metrics;
    - each `Flow`: a component's pods reach another's, on its ports, as pdserve's processes
      call each other (render.py lists them: the router calls the workers' gRPC port and
      Redis; a decode worker's KV ports admit the prefill workers only; Ray's pods reach each
      other on any port). Trust is by component: the endpoint picker (a third-party image) and
      the fetch Job (it downloads from the internet) are in no flow, and Redis admits the
      routers and workers only;
    - traced components reach the OTLP collector's port, wherever it is.
    Who may create pods in the namespace (and so label one as any component) is the boundary,
    with the cluster secret on every worker call and KV stream and the Redis password. Needs a
    CNI that enforces NetworkPolicy, egress included (Calico, Cilium, ...)."""
    everyone = {"matchLabels": PART_OF}
    prometheus = {"matchLabels": {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}}
    policies = [
        network_policy("pdserve-default-deny", {"podSelector": {}, "policyTypes": TYPES}),
        network_policy(
            "pdserve-dns",
            {
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [{"ports": [{"port": 53, "protocol": p} for p in ("UDP", "TCP")]}],
            },
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
                "podSelector": everyone,
                "policyTypes": ["Ingress"],
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
    for target in sorted({flow.target for flow in flows}):
        rules = _rules("from", [(f.source, f.ports) for f in flows if f.target == target])
        policies.append(
            network_policy(
                f"pdserve-to-{target}",
                {
                    "podSelector": {"matchLabels": labels(target)},
                    "policyTypes": ["Ingress"],
                    "ingress": rules,
                },
            )
        )
    for source in sorted({flow.source for flow in flows}):
        rules = _rules("to", [(f.target, f.ports) for f in flows if f.source == source])
        policies.append(
            network_policy(
                f"pdserve-from-{source}",
                {
                    "podSelector": {"matchLabels": labels(source)},
                    "policyTypes": ["Egress"],
                    "egress": rules,
                },
            )
        )
    if tracing:
        policies.append(
            network_policy(
                "pdserve-tracing",
                {
                    "podSelector": {
                        "matchExpressions": [
                            {
                                "key": COMPONENT,
                                "operator": "In",
                                "values": list(tracing.components),
                            }
                        ]
                    },
                    "policyTypes": ["Egress"],
                    "egress": [{"ports": [{"port": tracing.port, "protocol": "TCP"}]}],
                },
            )
        )
    return policies


TYPES = ["Ingress", "Egress"]
COMPONENT = "app.kubernetes.io/component"


def _rules(direction: str, peers: list[tuple[str, tuple[int, ...]]]) -> list[dict]:
    """One rule per set of ports, naming every component reached (or reaching) on them."""
    by_ports: dict[tuple[int, ...], list[str]] = {}
    for component, ports in peers:
        by_ports.setdefault(ports, []).append(component)
    rules = []
    for ports, components in by_ports.items():
        rule = {direction: [{"podSelector": {"matchLabels": labels(c)}} for c in components]}
        if ports:
            rule["ports"] = [{"port": port, "protocol": "TCP"} for port in ports]
        rules.append(rule)
    return rules


def network_policy(name: str, spec: dict) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": dict(PART_OF)},
        "spec": spec,
    }
