"""Prometheus Operator objects for either mode: a ServiceMonitor for the router's /metrics (TTFT,
ITL, routes, queue, 429s, KV transfers as the router saw them), a PodMonitor for each worker pod's
/metrics (vLLM's engine series and pdserve's worker series, labelled with the `pool` the
dashboard, the alerts and the autoscalers group by), and the alerts (alerts.yaml, package
data). Each carries `release: <release>`, the label a kube-prometheus-stack selects monitors and
rules by (its Helm release's name)."""

import importlib.resources

import yaml

from pdserve.cluster.k8s.objects import PART_OF, labels, metadata
from pdserve.core.kinds import Role

OPERATOR = "monitoring.coreos.com/v1"
SCRAPE_INTERVAL = "15s"
POOLS = (Role.PREFILL, Role.DECODE, Role.FLEX)
COMPONENT = "app.kubernetes.io/component"
COMPONENT_META = "__meta_kubernetes_pod_label_app_kubernetes_io_component"  # as Prometheus sees it


def monitoring_objects(release: str) -> list[dict]:
    return [_service_monitor(release), _pod_monitor(release), _alerts(release)]


def _released(name: str, component: str, release: str) -> dict:
    meta = metadata(name, component)
    meta["labels"]["release"] = release
    return meta


def _service_monitor(release: str) -> dict:
    """Through the router Service: the router Deployment, or the Ray head in kuberay mode."""
    return {
        "apiVersion": OPERATOR,
        "kind": "ServiceMonitor",
        "metadata": _released("pdserve-router", "router", release),
        "spec": {
            "selector": {"matchLabels": labels("router")},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": SCRAPE_INTERVAL}],
        },
    }


def _pod_monitor(release: str) -> dict:
    """The workers of deployments mode (a kuberay worker's metrics port is chosen at start)."""
    return {
        "apiVersion": OPERATOR,
        "kind": "PodMonitor",
        "metadata": _released("pdserve-workers", "workers", release),
        "spec": {
            "selector": {
                "matchLabels": dict(PART_OF),
                "matchExpressions": [
                    {"key": COMPONENT, "operator": "In", "values": [str(role) for role in POOLS]}
                ],
            },
            "podMetricsEndpoints": [
                {
                    "port": "metrics",
                    "path": "/metrics",
                    "interval": SCRAPE_INTERVAL,
                    "relabelings": [
                        {
                            "sourceLabels": [COMPONENT_META],
                            "targetLabel": "pool",
                        }
                    ],
                }
            ],
        },
    }


def _alerts(release: str) -> dict:
    rules = importlib.resources.files("pdserve.cluster.k8s").joinpath("alerts.yaml").read_text()
    return {
        "apiVersion": OPERATOR,
        "kind": "PrometheusRule",
        "metadata": _released("pdserve", "alerts", release),
        "spec": yaml.safe_load(rules),
    }
