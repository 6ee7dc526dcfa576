"""Per-pool autoscaling: a KEDA ScaledObject per worker Deployment, on the Prometheus series that
means pressure in that pool (the workers' vLLM metrics, labelled with `pool` by the PodMonitor in
pdserve/cluster/k8s/monitoring.py).

- prefill: prompts waiting in the prefill engines (`vllm:num_requests_waiting`): every one of them
  adds its wait to some request's TTFT. No worker exports its outstanding prompt tokens yet.
- decode: requests waiting in the decode engines (a full batch or a full KV cache) and the mean
  KV cache usage: a decode pool near full KV preempts, or refuses new leases.
- flex: a flex worker plays both roles, so both signals.

Scale-in is a pod deletion: the pod's preStop drain (pdserve/worker/drain.py) leaves the pools
and finishes what it holds, and one pod goes at a time (the pool's PodDisruptionBudget allows one).
"""

from dataclasses import dataclass

from pdserve.cluster.k8s.objects import metadata
from pdserve.core.kinds import Role

MAX_REPLICAS_FACTOR = 2  # up to twice the cluster file's replicas: a GPU budget, not a guess
WAITING_PER_PREFILL_WORKER = 2
WAITING_PER_DECODE_WORKER = 1
KV_USAGE_TARGET = 0.8  # mean fraction of the decode pool's KV cache in use
SCALE_DOWN_WINDOW_S = 300  # a burst's end is not a trend: wait before giving GPUs back
SCALE_DOWN_STEP_S = 120  # then one pod per step, each drained before the next goes


def scaled_object(
    role: str, replicas: int, leader_worker_set: bool, namespace: str, prometheus: str
) -> dict:
    """Scales the pool's Deployment, or its LeaderWorkerSet (a group of pods per worker), on
    `prometheus` (a URL) queried for the pool's pods in `namespace`."""
    pool = Pool(role, namespace, prometheus)
    triggers = []
    if role in (Role.PREFILL, Role.FLEX):
        triggers.append(pool.waiting(WAITING_PER_PREFILL_WORKER))
    if role in (Role.DECODE, Role.FLEX):
        triggers += [pool.waiting(WAITING_PER_DECODE_WORKER), pool.kv_usage()]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata(f"pdserve-{role}", role),
        "spec": {
            "scaleTargetRef": (
                {
                    "apiVersion": "leaderworkerset.x-k8s.io/v1",
                    "kind": "LeaderWorkerSet",
                    "name": f"pdserve-{role}",
                }
                if leader_worker_set
                else {"name": f"pdserve-{role}"}
            ),
            "minReplicaCount": replicas,
            "maxReplicaCount": replicas * MAX_REPLICAS_FACTOR,
            "pollingInterval": 15,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                        "scaleDown": {
                            "stabilizationWindowSeconds": SCALE_DOWN_WINDOW_S,
                            "policies": [
                                {"type": "Pods", "value": 1, "periodSeconds": SCALE_DOWN_STEP_S}
                            ],
                        },
                    }
                }
            },
            "triggers": triggers,
        },
    }


@dataclass(frozen=True)
class Pool:
    """A pool's series on one Prometheus."""

    role: str
    namespace: str
    prometheus: str

    @property
    def selector(self) -> str:
        return f'{{namespace="{self.namespace}",pool="{self.role}"}}'

    def waiting(self, per_worker: int) -> dict:
        """The pool's waiting requests, spread over its workers (HPA's AverageValue)."""
        query = f"sum(vllm:num_requests_waiting{self.selector})"
        return self._trigger(f"{self.role}-waiting", query, "AverageValue", per_worker)

    def kv_usage(self) -> dict:
        """The pool's mean KV usage against a target (HPA's Value: replicas x usage / target)."""
        query = f"avg(vllm:kv_cache_usage_perc{self.selector})"
        return self._trigger(f"{self.role}-kv-usage", query, "Value", KV_USAGE_TARGET)

    def _trigger(self, name: str, query: str, metric_type: str, threshold: float) -> dict:
        return {
            "type": "prometheus",
            "name": name,
            "metricType": metric_type,
            "metadata": {
                "serverAddress": self.prometheus,
                "query": query,
                "threshold": str(threshold),
            },
        }
