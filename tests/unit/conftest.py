"""The unit tier runs on every core (pytest-xdist, tests/xdist_groups.py): each file's tests stay
on one worker process (its module fixtures are made once), and the files that import vLLM (~10 s
of a core per process), `VLLM_MODULES`, share one, so vLLM is imported once per run."""

import atexit
import os
import sys

import pytest

from tests.xdist_groups import ModuleGroups

VLLM_MODULES = {
    "test_cache_salt",  # the worker's Generate turns a request's sampling into vLLM's
    "test_cluster_secret",  # a call let through reaches the worker's Generate, which imports vLLM
    "test_data_parallel_routing",
    "test_engine_stats",
    "test_flex_connector",
    "test_bench_metrics",
    "test_kv_compatibility",
    "test_kv_pool_copy",
    "test_mla_kv",
    "test_pool_contents",
    "test_route_choice",
    "test_router_tokenizer_loading",  # AutoTokenizer's import of torch: paid there already
    "test_wide_ep",
}


# The files that take longest, handed out first: given last, one process ran checkov's 18 s
# alone while the other had finished. The vLLM files first of all (one group: vLLM's import
# and their tests, ~20 s of a process), then those of 4-10 s each, longest first.
SLOWEST_FIRST = [
    *sorted(VLLM_MODULES),
    "test_nccl_fail_soft",
    "test_k8s_checkov",
    "test_bench_client",
    "test_kv_transports",
    "test_kv_preauth",
    "test_k8s_manifests",
    "test_k8s_render_options",
    "test_kv_pool_store",
    "test_fork_server",
]


def pytest_xdist_make_scheduler(config, log):
    return ModuleGroups(config, log, lambda module: "vllm" if module in VLLM_MODULES else module)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A worker process ends here, once its results are sent (xdist sends them in
    pytest_sessionfinish): its exit handlers run, but not the interpreter's teardown of every
    module and object (1-3 s of a core with torch, vLLM and gRPC loaded), which came after the
    last test and which the run waited for."""
    if hasattr(config, "workerinput"):
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def pytest_collection_finish(session):
    """No test file imports vLLM where it is collected (every process collects every file:
    ~4 s of a core each); its tests import it where they run."""
    if "vllm" in sys.modules and not session.config.option.collectonly:
        raise pytest.UsageError(
            "a test module imported vLLM at collection: import it inside the tests that use it"
        )


@pytest.fixture(autouse=True)
def _vllm_imported_only_where_it_is_shared(request):
    """A test that imports vLLM (~10 s of a core) outside `VLLM_MODULES` pays for it in a
    process of its own: it fails, naming the list to add its file to."""
    before = "vllm" in sys.modules
    yield
    module = request.module.__name__.rpartition(".")[2]
    if not before and "vllm" in sys.modules and module not in VLLM_MODULES:
        pytest.fail(f"{module} imports vLLM: add it to VLLM_MODULES in {__file__}")


def pytest_collection_modifyitems(config, items):
    """The unit tier's slowest files first (a stable sort: every file keeps its tests' order,
    and the tiers after it stay after it)."""
    rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}

    def key(item) -> int:
        package, _, module = item.module.__name__.rpartition(".")
        return rank.get(module, len(rank)) if package == __package__ else len(rank) + 1

    items.sort(key=key)


@pytest.fixture
def receiver():
    """A real KV receiver on 127.0.0.1 (the transport tests' peer) and its address."""
    from kv_transfer.kv_receiver import KvReceiver
    from tests.unit.kv_endpoints import CONSUMER

    kv_receiver = KvReceiver(CONSUMER)
    port = kv_receiver.start("127.0.0.1", 0)
    yield kv_receiver, f"127.0.0.1:{port}"
    kv_receiver.stop()
