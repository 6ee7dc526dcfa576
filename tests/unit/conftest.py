"""The unit tier runs on every core (pytest-xdist, tests/xdist_groups.py): each file's tests stay
on one worker process (its module fixtures are made once), and the files that import vLLM (~10 s
of a core per process), `VLLM_MODULES`, share one, so vLLM is imported once per run."""

import pytest

from tests.xdist_groups import ModuleGroups

VLLM_MODULES = {
    "test_attention_support",
    "test_bench_metrics",
    "test_kv_compatibility",
    "test_route_choice",
    "test_router_tokenizer_loading",  # AutoTokenizer's import of torch: paid there already
}


def pytest_xdist_make_scheduler(config, log):
    return ModuleGroups(config, log, lambda module: "vllm" if module in VLLM_MODULES else module)


@pytest.fixture
def receiver():
    """A real KV receiver on 127.0.0.1 (the transport tests' peer) and its address."""
    from kv_transfer.kv_receiver import KvReceiver
    from tests.unit.test_kv_transports import CONSUMER

    kv_receiver = KvReceiver(CONSUMER)
    port = kv_receiver.start("127.0.0.1", 0)
    yield kv_receiver, f"127.0.0.1:{port}"
    kv_receiver.stop()
