"""KV between worker pods over the cluster's fabric (`pdserve k8s render --rdma`,
`--fabric-key`).

A P/D pair's KV crosses pods (NCCL between GPU pods, gRPC otherwise), so where the pods land
decides what it costs: a preferred pod affinity on `fabric_key` (a node label whose value names a
fabric: the zone by default, a rail or NVLink domain label where the cluster has one, such as
GPU feature discovery's nvidia.com/gpu.clique) puts a pool's pods beside the other role's.
With RDMA (InfiniBand, RoCE), a GPU worker pod also requests the RDMA device plugin's resource
(`--rdma RESOURCE=N`, e.g. rdma/ib=1 or nvidia.com/hostdev=1) and may lock memory for NCCL's
registered buffers (the IPC_LOCK capability). Pod Security "restricted" and "baseline" both refuse
that capability, so the namespace then enforces no level (it still warns); /dev/shm is already a
memory volume sized for NCCL's host buffers (render.SHM)."""

from dataclasses import dataclass

from pdserve.cluster.k8s.objects import labels
from pdserve.core.kinds import Role

ZONE = "topology.kubernetes.io/zone"
# The role whose pods a pool's pods should sit beside: the other end of their KV transfers.
PEER = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL, Role.FLEX: Role.FLEX}


@dataclass(frozen=True)
class Rdma:
    """`RESOURCE=N`: the RDMA device plugin's extended resource, and how many a GPU pod takes."""

    resource: str
    count: int

    @classmethod
    def parse(cls, text: str) -> "Rdma":
        resource, _, count = text.partition("=")
        if "/" not in resource or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{text!r}: expected RESOURCE=N, e.g. rdma/ib=1")
        return cls(resource, int(count))


def fabric_affinity(role: str, fabric_key: str, suffix: str = "") -> dict:
    """A pool's pod spec's affinity: beside the pods of the role it moves KV with (whose
    component label is that role and `suffix`) on `fabric_key`; none when empty."""
    if not fabric_key or role not in PEER:
        return {}
    peers = labels(f"{PEER[role]}{suffix}")
    term = {"labelSelector": {"matchLabels": peers}, "topologyKey": fabric_key}
    preferred = [{"weight": 100, "podAffinityTerm": term}]
    return {
        "affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    }


def with_rdma(container: dict, rdma: Rdma | None) -> dict:
    """A GPU worker container that takes `rdma`'s devices and may lock memory for them."""
    if rdma is None:
        return container
    resources = container["resources"]
    for kind in ("requests", "limits"):
        resources[kind] = {**resources.get(kind, {}), rdma.resource: rdma.count}
    security = container["securityContext"]
    capabilities = {**security["capabilities"], "add": ["IPC_LOCK"]}
    container["securityContext"] = {**security, "capabilities": capabilities}
    return container
