"""The GPU worker's NCCL environment (pdserve/worker/gpu_environment.nccl_environment): a pdserve
KV group that fails or times out must not make torch's monitor of vLLM's world group (process
group 0) abort the worker (TORCH_NCCL_DUMP_ON_TIMEOUT=0, review §3.1); the variables pdserve's
groups are made with other values of are present from the start, so making a group replaces
values in place and never grows or shrinks the environment under vLLM's threads; all of it
reaches vLLM's Ray workers. Proved on a GPU by T1 (scripts/gpu_t1_pg0_kill.py)."""

import ast
import logging
import os
from pathlib import Path

from kv_transfer import nccl_transport
from pdserve.worker.gpu_environment import (
    DUMP_ON_TIMEOUT_ENV,
    KV_GROUP_TIMEOUT_S,
    MODEL_RUNNER_ENV,
    NCCL_SEEDS,
    RAY_COPY_ENV,
    nccl_environment,
    prepare_environment,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_gpu_worker_with_a_connector_keeps_vllms_monitor_off_other_groups_failures(caplog):
    environ = {RAY_COPY_ENV: "PDSERVE_CLUSTER_SECRET"}
    with caplog.at_level(logging.INFO, "pdserve.worker"):
        nccl_environment(has_connector=True, cpu=False, environ=environ)
    assert environ[DUMP_ON_TIMEOUT_ENV] == "0"
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # torch's default: vLLM's stands
    assert environ["TORCH_NCCL_ENABLE_MONITORING"] == "1"  # vLLM's hang detection stays
    assert environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == str(KV_GROUP_TIMEOUT_S)
    copied = environ[RAY_COPY_ENV].split(",")
    assert copied[0] == "PDSERVE_CLUSTER_SECRET"  # what was there stays, first
    assert set(copied) == {"PDSERVE_CLUSTER_SECRET", DUMP_ON_TIMEOUT_ENV, *NCCL_SEEDS}
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=0" in caplog.text
    nccl_environment(has_connector=True, cpu=False, environ=environ)  # twice: no duplicates
    assert sorted(environ[RAY_COPY_ENV].split(",")) == sorted(copied)


def test_a_cpu_worker_or_one_without_a_connector_is_left_alone():
    for has_connector, cpu in ((False, False), (True, True)):
        environ = {}
        nccl_environment(has_connector, cpu, environ)
        assert environ == {}


def test_the_users_own_values_stand_and_a_dump_on_timeout_is_warned_about(caplog):
    environ = {DUMP_ON_TIMEOUT_ENV: "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    with caplog.at_level(logging.INFO, "pdserve.worker"):
        nccl_environment(has_connector=True, cpu=False, environ=environ)
    assert environ[DUMP_ON_TIMEOUT_ENV] == "1"
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "abort this worker minutes later" in caplog.text


def test_the_seeds_are_what_a_pdserve_group_swaps_at_torchs_defaults():
    """nccl_transport makes its groups with other values of exactly these, and puts torch's
    defaults (the seeds) back: the two files agree, and GROUP_TIMEOUT_S is the seed's bound."""
    swapped = set(nccl_transport._NCCL_GROUP_ENV)
    assert swapped <= set(NCCL_SEEDS)
    assert {name: NCCL_SEEDS[name] for name in swapped} == nccl_transport._TORCH_DEFAULTS
    assert KV_GROUP_TIMEOUT_S == nccl_transport.GROUP_TIMEOUT_S


def test_in_a_worker_making_a_group_neither_adds_nor_removes_a_variable(monkeypatch):
    """setenv that grows the environment array (a new name) or unsetenv (which shifts it) can
    crash a getenv running in another thread; replacing a present name's value cannot (glibc
    keeps the array and every string it made)."""
    for name in NCCL_SEEDS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(DUMP_ON_TIMEOUT_ENV, raising=False)
    monkeypatch.setenv(RAY_COPY_ENV, "")
    nccl_environment(has_connector=True, cpu=False)  # the worker's start, on os.environ
    names = set(os.environ)
    with nccl_transport._nccl_group_env(nccl_transport.GROUP_TIMEOUT_S):
        assert set(os.environ) == names
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert set(os.environ) == names
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_prepare_environment_pins_the_runner_and_sets_nccl_and_make_engine_calls_it_first():
    environ = {}
    prepare_environment(has_connector=True, cpu=False, environ=environ)
    assert environ[MODEL_RUNNER_ENV] == "0" and environ[DUMP_ON_TIMEOUT_ENV] == "0"
    tree = ast.parse((ROOT / "pdserve" / "worker" / "engine.py").read_text())
    make_engine = next(
        node for node in ast.walk(tree) if getattr(node, "name", "") == "make_engine"
    )
    lines = {
        (node.func.id if isinstance(node.func, ast.Name) else node.func.attr): node.lineno
        for node in ast.walk(make_engine)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
    }
    # before vLLM builds anything (its process group 0 reads the environment when made)
    assert lines["prepare_environment"] < lines["AsyncEngineArgs"]
    assert lines["prepare_environment"] < lines["from_vllm_config"]
