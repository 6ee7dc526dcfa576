"""KV between worker pods over the fabric, rendered offline (pdserve/cluster/k8s/fabric.py): each
pool's pods prefer the nodes of the pods they move KV with on the fabric label; `--rdma` gives GPU
worker containers (a LeaderWorkerSet's ranks too) the RDMA resource and IPC_LOCK, and the
namespace then enforces no Pod Security level; every object still validates."""

import pytest

from pdserve.cli import main
from pdserve.cluster.k8s.fabric import ZONE, Rdma
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.k8s.render import render, write
from pdserve.settings.cluster_file import parse_cluster
from tests.unit.k8s_rendering import build, by_kind, main_container, rendered, seventy_b
from tests.unit.k8s_validation import validate_custom, validate_strictly

RDMA = RenderOptions(rdma=Rdma("rdma/ib", 1), fabric_key="nvidia.com/gpu.clique")
ENFORCE = "pod-security.kubernetes.io/enforce"


def peer_and_key(pod: dict) -> tuple[str, str]:
    (preferred,) = pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    return term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"], term["topologyKey"]


@pytest.mark.parametrize("options, key", [(RenderOptions(), ZONE), (RDMA, RDMA.fabric_key)])
def test_each_pool_prefers_its_kv_peers_nodes_on_the_fabric_label(tmp_path, options, key):
    deployments = by_kind(rendered(tmp_path, "deployments", options), "Deployment")
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        pod = deployments[f"pdserve-{role}"]["spec"]["template"]["spec"]
        assert peer_and_key(pod) == (peer, key)
    assert "affinity" not in deployments["pdserve-router"]["spec"]["template"]["spec"]


def test_kuberay_groups_prefer_the_peer_groups_nodes(tmp_path):
    (job,) = by_kind(rendered(tmp_path, "kuberay", RDMA), "RayJob").values()
    groups = {
        g["groupName"]: g["template"]["spec"]
        for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    }
    assert peer_and_key(groups["prefill"]) == ("decode-node", RDMA.fabric_key)
    assert peer_and_key(groups["decode"]) == ("prefill-node", RDMA.fabric_key)
    for spec in groups.values():
        (container,) = spec["containers"]
        assert container["resources"]["limits"]["rdma/ib"] == 1


def test_rdma_gives_gpu_workers_the_devices_and_memory_locking(tmp_path):
    objects = rendered(tmp_path, "deployments", RDMA)
    validate_strictly(objects)
    (namespace,) = by_kind(objects, "Namespace").values()
    assert ENFORCE not in namespace["metadata"]["labels"]  # IPC_LOCK is beyond baseline
    deployments = by_kind(objects, "Deployment")
    for role in ("prefill", "decode"):
        worker = main_container(deployments[f"pdserve-{role}"]["spec"]["template"]["spec"])
        for kind in ("requests", "limits"):
            assert worker["resources"][kind]["rdma/ib"] == 1
        assert worker["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    (router,) = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"]
    assert "add" not in router["securityContext"]["capabilities"]


def test_without_rdma_the_namespace_enforces_restricted(tmp_path):
    (namespace,) = by_kind(rendered(tmp_path, "deployments", RenderOptions()), "Namespace").values()
    assert namespace["metadata"]["labels"][ENFORCE] == "restricted"


def test_a_leader_worker_sets_ranks_take_rdma_too(tmp_path):
    out = tmp_path / "deployments"
    options = RenderOptions(gpus_per_node=4, rdma=Rdma("rdma/ib", 2))
    write(render(parse_cluster(seventy_b(8, 4)), "deployments", options), out)
    group = by_kind(build(out), "LeaderWorkerSet")["pdserve-prefill"]
    validate_custom(group, "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    for template in ("leaderTemplate", "workerTemplate"):
        (container,) = group["spec"]["leaderWorkerTemplate"][template]["spec"]["containers"]
        assert container["resources"]["limits"]["rdma/ib"] == 2


@pytest.mark.parametrize("bad", ["rdma/ib", "ib=1", "rdma/ib=0", "rdma/ib=x"])
def test_a_bad_rdma_resource_is_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit):
        main(["k8s", "render", "-f", "x.yaml", "--rdma", bad])
    assert "RESOURCE=N" in capsys.readouterr().err
