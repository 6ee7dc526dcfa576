"""Tensor parallelism on CPU (vLLM's multiprocessing executor; its CPU backend has no Ray
executor) with the tiny random-weight Llama (4 heads, 2 KV heads), in every pairing of the KV
path: prefill TP=2 -> decode TP=1 (each decode rank merges the heads of two prefill ranks),
prefill TP=1 -> decode TP=2 (the prefill rank splits its heads over two decode ranks), and
TP=2 -> TP=2 (rank r sends its KV heads to rank r), plus the local path at TP=2. Greedy output
must equal vLLM's offline engine at TP=1 on the same weights, and on a disaggregated request the
decode worker must have computed no prompt token: every head of every layer arrived.

Two clusters give the workers: the first has two TP=2 prefill workers (round-robin) sharing the
host's KV pool, the second a TP=2 decode worker; a router over one of the first's prefill
workers and that decode worker serves the TP=2 -> TP=2 pairing (workers of two clusters share
the session's secret). A long prompt computed by one TP=2 prefill worker is loaded from the
pool by the other, each rank its own heads, and answered the same. When the clusters have
stopped, their engines have left nothing in /dev/shm."""

import pytest

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import GetStats
from pdserve.model_store.store import ensure_model
from tests.integration.conftest import _stop_and_check, router_over, start_server, tiny_completion
from tests.integration.http_client import HTTP
from tests.integration.processes import SHM, kv_pool_address, shm_left_since, worker_pids
from tests.integration.prompts import TINY_LONG_PROMPT
from tests.integration.prompts import TINY_PROMPTS as PROMPTS
from tests.waiting import wait_for


@pytest.fixture(scope="module", autouse=True)
def no_engine_files_left_in_dev_shm():
    """At TP 2 vLLM's multiprocessing executor keeps message queues (psm_*) and its CPU
    communicator (vllm_dist_*) in /dev/shm: once this module's clusters have stopped, none of
    those files is left (each worker removes what its engine left; the other stream's engines
    map theirs while they run)."""
    before = set(SHM.iterdir())
    yield
    left = [name for name in shm_left_since(before) if name.startswith(("psm_", "vllm_dist_"))]
    assert not left, f"left in /dev/shm after the clusters stopped: {left}"


def tiny_cluster(tmp_path_factory, prefill_tp: int, decode_tp: int, *more: str):
    ensure_model("tiny")
    return start_server(
        tmp_path_factory.mktemp(f"tp{prefill_tp}to{decode_tp}"),
        "--model",
        "tiny",
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--tensor-parallel-size",
        str(decode_tp),
        *more,
    )


@pytest.fixture(scope="module")
def prefill_tp2(tmp_path_factory):
    server = tiny_cluster(tmp_path_factory, 2, 1, "--prefill", "2", "--policy", "round-robin")
    yield server
    _stop_and_check(server)


@pytest.fixture(scope="module")
def decode_tp2(tmp_path_factory):
    server = tiny_cluster(tmp_path_factory, 1, 2)
    yield server
    _stop_and_check(server)


@pytest.fixture(scope="module")
def both_tp2(prefill_tp2, decode_tp2, tmp_path_factory):
    """A router over the TP=2 prefill worker and the TP=2 decode worker; yields its URL."""
    prefill = next(w for w in prefill_tp2.workers() if w["role"] == "prefill")
    addresses = [prefill["address"], decode_tp2.worker("decode")["address"]]
    folder = tmp_path_factory.mktemp("tp2to2")
    with router_over(addresses, folder, model="tiny", served_model_name="tiny") as url:
        yield url


ROUTERS = {
    "prefill2-decode1": lambda request: request.getfixturevalue("prefill_tp2").url,
    "prefill1-decode2": lambda request: request.getfixturevalue("decode_tp2").url,
    "prefill2-decode2": lambda request: request.getfixturevalue("both_tp2"),
}
CASES = [
    ("prefill2-decode1", "disaggregated"),
    ("prefill1-decode2", "disaggregated"),
    ("prefill2-decode2", "disaggregated"),
    ("prefill2-decode2", "local"),  # the TP=2 decode worker alone
]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
@pytest.mark.parametrize("pairing, route", CASES)
def test_tp_output_equals_tp1_offline(request, tiny_reference, pairing, route, index):
    response = tiny_completion(ROUTERS[pairing](request), PROMPTS[index], route)
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-route"] == route
    body = response.json()
    expected = tiny_reference["prompts"][index]
    assert len(set(expected["token_ids"])) > 1, "the reference repeats one token: a weak check"
    assert body["choices"][0]["text"] == expected["text"]
    if route == "disaggregated":
        assert (
            int(response.headers["x-pdserve-decode-cached-tokens"])
            == body["usage"]["prompt_tokens"]
        )
        assert body["pdserve_timing"]["kv_bytes"] > 0


def test_a_tp2_prefill_worker_loads_from_the_pool_what_the_other_computed(prefill_tp2):
    """Each rank of the first prefill worker stores its heads of the prompt's blocks; the other
    prefill worker's ranks load them (the store counts the hits) and it answers exactly as the
    worker that computed them, logprobs included: a part loaded into the wrong rank, or not
    at all, would change them."""
    (address,) = {kv_pool_address(pid) for pid in worker_pids(prefill_tp2, "prefill")}
    store = PoolClient(address, namespace=None)
    first = _long_completion(prefill_tp2.url)
    wait_for(lambda: store.call(GetStats()).used >= 2, 30, "the prompt's blocks in the pool")
    hits = store.call(GetStats()).hits
    second = _long_completion(prefill_tp2.url)  # round-robin: the other prefill worker
    assert len({first["worker"], second["worker"]}) == 2, (first["worker"], second["worker"])
    assert store.call(GetStats()).hits > hits
    assert second["text"] == first["text"]
    assert second["logprobs"] == pytest.approx(first["logprobs"], abs=1e-4)


def _long_completion(url: str) -> dict:
    reply = HTTP.post(
        f"{url}/v1/completions",
        timeout=120,
        headers={"x-pdserve-route": "disaggregated"},
        json={
            "model": "tiny",
            "prompt": TINY_LONG_PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
        },
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return {
        "worker": reply.headers["x-pdserve-prefill-worker"],
        "text": choice["text"],
        "logprobs": choice["logprobs"]["token_logprobs"],
    }


def test_a_transfer_to_a_tp2_decode_worker_counts_every_ranks_bytes(prefill_tp2, decode_tp2):
    """Each decode rank receives its heads and reports its part; the transfer's figures are
    the ranks' merged: the same bytes as into one TP=1 decode worker."""
    sizes = {}
    for name, server in (("decode TP=1", prefill_tp2), ("decode TP=2", decode_tp2)):
        response = tiny_completion(server.url, PROMPTS[2], "disaggregated")
        assert response.status_code == 200, response.text
        sizes[name] = response.json()["pdserve_timing"]["kv_bytes"]
    assert sizes["decode TP=1"] == sizes["decode TP=2"] > 0, sizes
