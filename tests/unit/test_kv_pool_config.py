"""Which workers' engines join the host KV pool, and how (pdserve/worker/engine.py's
kv_transfer_config, pdserve/settings/worker.py): colocated workers through the pool's
connector alone, prefill and decode workers through vLLM's MultiConnector with their own
connector first (a prefill worker's finds nothing to load, so the pool's answer is the one
loaded; a decode worker's loads what a prefill worker sent, the pool's the prompts it computes
itself; a flex worker's both halves, then the pool's), at any tensor parallelism."""

import pytest

from pdserve.settings.engine import EngineSettings
from pdserve.settings.worker import WorkerSettings
from pdserve.worker.engine import kv_transfer_config

POOL = "@pdserve-kv-pool-test"


def test_a_colocated_worker_uses_the_pools_connector_only_with_an_address_and_on():
    config = kv_transfer_config(WorkerSettings(kv_pool_address=POOL), 0)
    assert config["kv_connector"] == "PoolConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["pool_address"] == POOL
    assert kv_transfer_config(WorkerSettings(), 0) is None
    assert kv_transfer_config(WorkerSettings(kv_pool="off", kv_pool_address=POOL), 0) is None


def test_a_tensor_parallel_worker_uses_the_pool_too():
    """Each rank copies its own heads of a block (kv_transfer/pool/copy.py)."""
    engine = EngineSettings(tensor_parallel_size=2)
    settings = WorkerSettings(role="prefill", kv_pool_address=POOL, engine=engine)
    assert settings.wants_kv_pool and settings.pooled
    children = kv_transfer_config(settings, 0)["kv_connector_extra_config"]["connectors"]
    assert children[1]["kv_connector"] == "PoolConnector"


def test_a_prefill_worker_composes_its_producer_and_then_the_pool():
    config = kv_transfer_config(WorkerSettings(role="prefill", kv_pool_address=POOL), 0)
    assert config["kv_connector"] == "MultiConnector"
    children = config["kv_connector_extra_config"]["connectors"]
    assert [child["kv_connector"] for child in children] == ["PrefillConnector", "PoolConnector"]
    plain = kv_transfer_config(WorkerSettings(role="prefill"), 0)
    assert plain["kv_connector"] == "PrefillConnector" and children[0] == plain


def test_a_decode_worker_composes_its_consumer_and_then_the_pool():
    settings = WorkerSettings(role="decode", kv_pool_address=POOL)
    config = kv_transfer_config(settings, 7000)
    assert config["kv_connector"] == "MultiConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    children = config["kv_connector_extra_config"]["connectors"]
    assert [child["kv_connector"] for child in children] == ["DecodeConnector", "PoolConnector"]
    plain = kv_transfer_config(settings.model_copy(update={"kv_pool_address": ""}), 7000)
    assert plain["kv_connector"] == "DecodeConnector" and children[0] == plain


def test_a_flex_worker_composes_both_its_halves_and_then_the_pool():
    settings = WorkerSettings(role="flex", kv_pool_address=POOL)
    config = kv_transfer_config(settings, 7000)
    assert config["kv_connector"] == "MultiConnector"
    children = config["kv_connector_extra_config"]["connectors"]
    assert [child["kv_connector"] for child in children] == ["FlexConnector", "PoolConnector"]
    plain = kv_transfer_config(settings.model_copy(update={"kv_pool": "off"}), 7000)
    assert plain["kv_connector"] == "FlexConnector" and children[0] == plain


@pytest.mark.parametrize("role", ["decode", "flex"])
def test_a_worker_that_fails_requests_whose_kv_fails_uses_no_pool(role):
    """vLLM applies one failure policy to every connector's loads: under `fail`, a pool block
    evicted between its lookup and its load would end the request, not be computed."""
    settings = WorkerSettings(role=role, kv_pool_address=POOL, kv_failure_policy="fail")
    assert not settings.wants_kv_pool and not settings.pooled
    config = kv_transfer_config(settings, 7000)
    assert config["kv_connector"] != "MultiConnector"
    assert config["kv_load_failure_policy"] == "fail"
    prefill = WorkerSettings(role="prefill", kv_pool_address=POOL, kv_failure_policy="fail")
    assert prefill.pooled  # it loads nothing but from the pool: its policy is the pool's
