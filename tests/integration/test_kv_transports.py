"""A mixed pool: three prefill workers forced onto grpc, nccl (gloo on CPU) and shm, one decode
worker on auto, so each pair uses its own transport. Greedy outputs equal vLLM's own on every
transport, each transfer labelled with what carried it; fifty aborts leave no KV behind and open
no new process group per transfer; every prefill worker killed mid-transfer is recomputed
correctly at once."""

import httpx
import pytest

from tests.integration.conftest import SERVED_MODEL, _stop_and_check, start_server
from tests.integration.kv_stress import abort_fifty_requests, kill_prefill_workers_mid_transfer
from tests.integration.prompts import DISAGGREGATED_MAX_TOKENS, DISAGGREGATED_PROMPTS

FORCED = ("grpc", "nccl", "shm")


@pytest.fixture(scope="module")
def mixed_cluster(smollm2_dir, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("mixed-transports"),
        "--prefill",
        str(len(FORCED)),
        "--prefill-kv-transports",
        ",".join(FORCED),
        "--kv-timeout",
        "30",
    )
    yield server
    _stop_and_check(server)


def test_each_pair_uses_its_transport_and_the_output_equals_vllms(mixed_cluster, offline_reference):
    carried: dict[str, set[str]] = {}
    for index, prompt in enumerate(DISAGGREGATED_PROMPTS):
        response = httpx.post(
            f"{mixed_cluster.base_url}/completions",
            json={
                "model": SERVED_MODEL,
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": DISAGGREGATED_MAX_TOKENS,
            },
            headers={"x-pdserve-route": "disaggregated", "x-pdserve-timing": "1"},
            timeout=300,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == offline_reference["disaggregated"][index]["text"]
        assert (
            int(response.headers["x-pdserve-decode-cached-tokens"])
            == (body["usage"]["prompt_tokens"])
        ), "the decode worker prefilled: the KV did not arrive"
        worker = response.headers["x-pdserve-prefill-worker"]
        carried.setdefault(worker, set()).add(body["pdserve_timing"]["kv_transport"])
    assert sorted(kinds for kinds in map(tuple, carried.values())) == [(k,) for k in FORCED]
    metrics = httpx.get(f"{mixed_cluster.url}/metrics", timeout=10).text
    for kind in FORCED:
        assert f'pdserve_kv_transfers_total{{outcome="loaded",transport="{kind}"}}' in metrics
    assert 'outcome="failed"' not in metrics


def test_fifty_aborts_leave_no_kv_behind_and_reuse_the_process_groups(mixed_cluster):
    abort_fifty_requests(mixed_cluster)
    decode_log = next(mixed_cluster.log_dir.glob("decode-*.log")).read_text()
    # One pairwise group per channel (prefill rank -> decode rank), reused by every transfer.
    assert 1 <= decode_log.count("KV gloo group with") <= 2, decode_log.count("KV gloo group with")


def test_every_prefill_worker_killed_mid_transfer_is_recomputed(mixed_cluster):
    kill_prefill_workers_mid_transfer(mixed_cluster)
