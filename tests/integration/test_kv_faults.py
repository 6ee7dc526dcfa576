"""Injected KV faults on every transport, through real engines: one `pdserve serve` cluster of
three prefill workers forced onto grpc, nccl (gloo on CPU) and shm and one decode worker
(policy recompute), integrity on (the default). Each test sets one fault kind on every prefill
worker at rate 1 (SetKvFault: no engine restarts) and sends one request through each prefill
worker: every response equals the local path's greedy output, the decode worker counts each
caught transfer in pdserve_kv_integrity_failures_total by transport and kind, and every KV
block is free afterwards."""

import grpc
import httpx
import pytest

from pdserve.settings.cluster_secret import secret_metadata
from pdserve.worker.protocol import worker_pb2, worker_pb2_grpc
from tests.integration.conftest import SERVED_MODEL, _stop_and_check, start_server
from tests.integration.prompts import long_prompt
from tests.integration.test_worker_observability import metrics_url, scrape
from tests.waiting import wait_for

FORCED = ("grpc", "nccl", "shm")
CARRIED_BY = {"grpc", "gloo", "shm"}  # what the decode worker labels them (nccl is gloo on CPU)
# One KV block or less (128 tokens on CPU): no prefix-cache block is ever shared, so each
# request's KV comes whole from its prefill worker, and a test stays short.
PROMPTS = [f"Note {i}. " + long_prompt(60) for i in range(len(FORCED))]
MAX_TOKENS = 6
CAUGHT_AS = {
    "corrupt": "digest",
    "truncate": "length",
    "duplicate": "duplicate",
    "reorder": "order",
    "stale": "stale",
}


@pytest.fixture(scope="module")
def cluster(smollm2_dir, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("kv-faults"),
        "--prefill",
        str(len(FORCED)),
        "--prefill-kv-transports",
        ",".join(FORCED),
        "--policy",
        "round-robin",  # consecutive requests go through each prefill worker in turn
        "--kv-timeout",
        "30",
    )
    yield server
    _stop_and_check(server)


@pytest.fixture(scope="module")
def local_outputs(cluster) -> dict[str, str]:
    """Each prompt's greedy output on the local path (the decode worker prefills it itself)."""
    return {
        prompt: complete(cluster, prompt, "local").json()["choices"][0]["text"]
        for prompt in PROMPTS
    }


def complete(server, prompt: str, route: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/completions",
        json={"model": SERVED_MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS},
        headers={"x-pdserve-route": route, "x-pdserve-timing": "1"},
        timeout=120,
    )


def set_fault(server, fault: str) -> None:
    for worker in server.workers():
        if worker["role"] == "prefill":
            with grpc.insecure_channel(worker["address"]) as channel:
                worker_pb2_grpc.WorkerStub(channel).SetKvFault(
                    worker_pb2.KvFault(fault=fault), timeout=10, metadata=secret_metadata()
                )


def integrity_failures(server) -> dict[tuple[str, str], float]:
    """The decode worker's pdserve_kv_integrity_failures_total, by (transport, kind)."""
    decode = server.worker("decode")
    counts = {}
    for series, value in scrape(metrics_url(server, "decode", decode["address"])).items():
        if series.startswith("pdserve_kv_integrity_failures_total{"):
            labels = dict(
                part.split("=") for part in series.split("{", 1)[1].rstrip("}").split(",")
            )
            counts[labels["transport"].strip('"'), labels["kind"].strip('"')] = value
    return counts


def one_round(server, local_outputs) -> set[str]:
    """Each prompt once, through the next prefill worker: the output must be the local path's
    (or, were the policy fail, a clean error); the transports that carried them."""
    carried = set()
    for prompt in PROMPTS:
        response = complete(server, prompt, "disaggregated")
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == local_outputs[prompt]
        carried.add(body["pdserve_timing"]["kv_transport"])
    return carried


def blocks_back_to_baseline(server) -> None:
    wait_for(
        lambda: all(w.get("kv_blocks_used") == 0 for w in server.workers(fresh=True)),
        30,
        "every worker's KV blocks free again",
        poll_s=0.5,
    )


@pytest.fixture
def fault(cluster, request):
    """Sets the test's fault kind on every prefill worker (rate 1), and none after it."""
    set_fault(cluster, f"{request.param}:1")
    yield request.param
    set_fault(cluster, "")


def test_without_faults_every_transfer_loads_and_nothing_is_counted(cluster, local_outputs):
    assert one_round(cluster, local_outputs) == set(FORCED)
    blocks_back_to_baseline(cluster)
    assert integrity_failures(cluster) == {}


@pytest.mark.parametrize("fault", [*CAUGHT_AS, "delay"], indirect=True)
def test_an_injected_fault_is_caught_on_every_transport_and_the_output_stays_right(
    cluster, local_outputs, fault
):
    before = integrity_failures(cluster)
    rounds = 2 if fault == "stale" else 1  # a stale slice needs a transfer before it
    for _ in range(rounds):
        assert one_round(cluster, local_outputs) == set(FORCED)
    blocks_back_to_baseline(cluster)
    after = integrity_failures(cluster)
    caught = {key: after[key] - before.get(key, 0) for key in after}
    caught = {key: count for key, count in caught.items() if count}
    if fault == "delay":  # late, not wrong: nothing to catch
        assert caught == {}
    else:
        assert caught == {(transport, CAUGHT_AS[fault]): 1 for transport in CARRIED_BY}
