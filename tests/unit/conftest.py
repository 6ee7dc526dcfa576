"""The unit tier runs on every core (pytest-xdist, `--dist loadgroup`): each file's tests stay on
one worker process (its module fixtures are made once), and the files that import vLLM (~10 s
of a core per process) share one, marked `VLLM_GROUP`, so vLLM is imported once per run."""

import pytest

VLLM_GROUP = pytest.mark.xdist_group("imports-vllm")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture
def receiver():
    """A real KV receiver on 127.0.0.1 (the transport tests' peer) and its address."""
    from kv_transfer.kv_receiver import KvReceiver
    from tests.unit.test_kv_transports import CONSUMER

    kv_receiver = KvReceiver(CONSUMER)
    port = kv_receiver.start("127.0.0.1", 0)
    yield kv_receiver, f"127.0.0.1:{port}"
    kv_receiver.stop()
