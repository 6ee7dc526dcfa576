"""The Gateway API Inference Extension's objects for a pdserve cluster: an InferencePool whose
endpoints are the router pods, the endpoint picker (EPP) the pool names, and an HTTPRoute from a
Gateway the platform team runs to the pool.

Why the routers are the pool's endpoints and not the workers: the model-server protocol asks an
endpoint to serve OpenAI's Completions and Chat APIs, and a pdserve worker serves the worker gRPC
protocol (under the cluster secret) only; and a disaggregated request needs two picks (a prefill
and a decode worker) and a KV handoff between them, where an EPP picks one endpoint per request.
So the gateway balances between routers and each router picks P and D. Why the upstream EPP and
not pdserve's router as the picker: an EPP is an Envoy ext_proc server that answers with one
`ip:port`; the router would have to become that server and still proxy the stream itself.
"""

from pdserve.cluster.k8s.objects import NO_ESCALATION, NON_ROOT, labels, metadata

POOL = "pdserve"
EPP = f"{POOL}-epp"
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
EPP_GRPC_PORT = 9002  # ext_proc, what the gateway calls
EPP_HEALTH_PORT = 9003
API_SERVER_PORTS = (443, 6443)  # the kubernetes Service's, and the control plane's own
GATEWAY = "inference-gateway"  # the platform's Gateway (its class is the implementation's)
INFERENCE_GROUP = "inference.networking.k8s.io"


EPP_NEEDS_THE_API = "the endpoint picker watches its InferencePool and the pods through the API"


def gateway_objects(router_port: int, namespace: str) -> list[dict]:
    return [
        inference_pool(router_port),
        http_route(),
        *endpoint_picker(namespace, router_port),
    ]


def inference_pool(router_port: int) -> dict:
    return {
        "apiVersion": f"{INFERENCE_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": metadata(POOL, "router"),
        "spec": {
            "selector": {"matchLabels": labels("router")},
            "targetPorts": [{"number": router_port}],
            # The routers are interchangeable front doors: with the picker down, any router is
            # a right answer, so the gateway keeps sending rather than failing every request.
            "endpointPickerRef": {
                "name": EPP,
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": "FailOpen",
            },
        },
    }


def http_route() -> dict:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": metadata(POOL, "router"),
        "spec": {
            "parentRefs": [{"name": GATEWAY}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                    "backendRefs": [
                        {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": POOL}
                    ],
                    # A long generation streams for minutes: the route must not cut it.
                    "timeouts": {"request": "0s"},
                }
            ],
        },
    }


def endpoint_picker(namespace: str, router_port: int) -> list[dict]:
    """The upstream reference EPP, watching this namespace's pool and the pods it selects. A
    third-party image holding an API token: it is in no flow of pdserve's NetworkPolicies (it
    reaches neither Redis nor a worker), and besides DNS it reaches only the routers' port (the
    pool's endpoints, whose metrics it reads) and the Kubernetes API (ports 443 and 6443,
    wherever the control plane is): not the cloud's metadata service (port 80)."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(EPP, "epp")}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(EPP, "epp"),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": [INFERENCE_GROUP],
                "resources": ["inferencepools"],
                "verbs": ["get", "list", "watch"],
            },
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives"],
                "verbs": ["get", "list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(EPP, "epp"),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": EPP},
        "subjects": [{"kind": "ServiceAccount", "name": EPP, "namespace": namespace}],
    }
    health = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": "epp",
        "image": EPP_IMAGE,
        "args": ["--pool-name", POOL, "--pool-namespace", namespace, "--zap-encoder", "json"],
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
        ],
        "readinessProbe": {**health, "periodSeconds": 5},
        "livenessProbe": {**health, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": NO_ESCALATION,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **metadata(EPP, "epp"),
            # deploy/k8s/checkov.yaml's scan: the one pod here that calls the API keeps its token.
            "annotations": {"checkov.io/skip1": f"CKV_K8S_38={EPP_NEEDS_THE_API}"},
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels("epp")},
            "template": {
                "metadata": {"labels": labels("epp")},
                "spec": {
                    "serviceAccountName": EPP,
                    "securityContext": NON_ROOT,
                    "containers": [container],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(EPP, "epp"),
        "spec": {
            "selector": labels("epp"),
            "ports": [
                {
                    "name": "grpc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc",
                    "appProtocol": "http2",
                }
            ],
        },
    }
    # The Gateway's proxy (in its own namespace) calls the picker; pdserve.yaml's policies deny
    # every pod of the namespace what they do not allow (base.py).
    reachable = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(EPP, "epp"),
        "spec": {
            "podSelector": {"matchLabels": labels("epp")},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"port": EPP_GRPC_PORT, "protocol": "TCP"}]}],
        },
    }
    egress = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(f"{EPP}-egress", "epp"),
        "spec": {
            "podSelector": {"matchLabels": labels("epp")},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": labels("router")}}],
                    "ports": [{"port": router_port, "protocol": "TCP"}],
                },
                {"ports": [{"port": port, "protocol": "TCP"} for port in API_SERVER_PORTS]},
            ],
        },
    }
    return [account, role, binding, deployment, service, reachable, egress]
