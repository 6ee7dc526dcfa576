"""Pools whose workers span nodes, as LeaderWorkerSets (a group of pods per replica, created,
restarted and deleted as one).

A data-parallel group over nodes (a wide-EP pool: DeepSeek at DP 16 on 8-GPU nodes): every pod
of the group is one of its pdserve workers, one per node (`data_parallel_set`). The leader pod
runs node 0; each other pod runs node LWS_WORKER_INDEX, whose engine joins node 0's at the
leader's address (LWS_LEADER_ADDRESS, set by the LeaderWorkerSet controller). Each is a whole
worker (its ranks, gRPC port, KV receivers and KV pool), so all are the pool's component; a lost
pod fails the group's engines (their all-to-all waits on every rank), and the group restarts
whole (RecreateGroupOnPodRestart).

A tensor-parallel group over nodes (70B at TP 8 on 4-GPU nodes, 405B): one group of pods per
pdserve worker (`leader_worker_set`). The leader pod starts a Ray head and runs
the pdserve worker on it (its engine sees more ranks than local GPUs and takes vLLM's Ray
executor: pdserve/worker/engine.py); every other pod of the group joins that Ray cluster at the
leader's address (LWS_LEADER_ADDRESS, set by the LeaderWorkerSet controller) and lends it its
GPUs. A group is created, restarted and deleted as one: a lost rank kills the engine anyway.

Prefill pools only: a decode worker's KV receivers run in its ranks' processes, and a worker
advertises one host for all of them, which the follower pods' ranks do not listen on.

Why not a DisaggregatedSet: it makes prefill and decode one topology with vLLM-style sidecars
between them; pdserve's pools are already separate and joined by its own registry and router,
so only the multi-node group is needed, per pool.

The group's Ray cluster runs Ray's token auth (review C1): every pod of it has RAY_AUTH_MODE=token
and RAY_AUTH_TOKEN from the Secret `pdserve-ray-token` (key `token`, which the user creates, as
the cluster secret), so a pod without the token can neither join it nor run code on it; the
head has no dashboard.
"""

import copy
import shlex

from pdserve.cluster.k8s.objects import NO_ESCALATION, labels, metadata

RAY_PORT = 6379
RANK_SUFFIX = "-rank"  # a group's pods but the leader: component <role>-rank
RAY_TOKEN_SECRET = "pdserve-ray-token"
RAY_AUTH_ENV = [
    {"name": "RAY_AUTH_MODE", "value": "token"},
    {
        "name": "RAY_AUTH_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": RAY_TOKEN_SECRET, "key": "token"}},
    },
]


def leader_worker_set(
    role: str, replicas: int, nodes: int, leader_spec: dict, follower_spec: dict
) -> dict:
    """`leader_spec`: the pool's worker pod, whose one container runs `pdserve worker ...`."""
    (worker,) = leader_spec["containers"]
    start = ["ray", "start", "--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
    start.append("--disable-usage-stats")
    leader = dict(
        worker,
        command=["sh", "-c", f"{shlex.join(start)} && exec pdserve {shlex.join(worker['args'])}"],
    )
    del leader["args"]
    leader["env"] = [
        *worker["env"],
        *RAY_AUTH_ENV,
        {"name": "RAY_ADDRESS", "value": f"127.0.0.1:{RAY_PORT}"},
    ]
    leader["ports"] = worker["ports"] + [{"name": "ray", "containerPort": RAY_PORT}]
    leader_spec = dict(leader_spec, containers=[leader])
    return _group_set(role, replicas, nodes, leader_spec, follower_spec, f"{role}{RANK_SUFFIX}")


def data_parallel_set(role: str, replicas: int, nodes: int, worker_spec: dict) -> dict:
    """`worker_spec`: the pool's worker pod (its container `worker` runs `pdserve worker ...`
    with the group's settings); the other pods' worker runs the node of its index, joining the
    leader's."""
    member = copy.deepcopy(worker_spec)
    (worker,) = [c for c in member["containers"] if c["name"] == "worker"]
    worker["args"] += [
        "--data-parallel-node",
        "$(LWS_WORKER_INDEX)",
        "--data-parallel-address",
        "$(LWS_LEADER_ADDRESS)",
    ]
    return _group_set(role, replicas, nodes, worker_spec, member, role)


def _group_set(
    role: str, replicas: int, nodes: int, leader_spec: dict, member_spec: dict, member: str
) -> dict:
    """`replicas` groups of `nodes` pods: the leader's, and `member` component pods."""
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": metadata(f"pdserve-{role}", role),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": labels(role)}, "spec": leader_spec},
                "workerTemplate": {"metadata": {"labels": labels(member)}, "spec": member_spec},
            },
        },
    }


def ray_follower_container(image: str, env: list[dict], resources: dict, gpus: int) -> dict:
    """A group pod that only lends its GPUs to the leader's Ray cluster (with its token)."""
    join = ["ray", "start", "--address=$(LWS_LEADER_ADDRESS):" + str(RAY_PORT)]
    join += [f"--num-gpus={gpus}", "--block", "--disable-usage-stats"]
    return {
        "name": "ray-rank",
        "image": image,
        "command": join,
        "env": [*env, *RAY_AUTH_ENV],
        "resources": resources,
        "securityContext": NO_ESCALATION,
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
