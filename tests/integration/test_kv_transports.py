"""Every KV transport through real engines, on the session's mixed pool: three prefill workers
forced onto grpc, nccl (gloo on CPU) and shm, two decode workers on auto (policy recompute),
round-robin, so consecutive requests go through each prefill worker in turn and each uses its
own transport.

Greedy outputs equal vLLM's own on every transport, each transfer labelled with what carried
it; an injected fault of each kind (tests/kv_faults.py, rate 1, set in the running workers: no
engine restarts) is caught on every transport by the integrity check, counted by transport and
kind, and the output stays the local path's; fifty aborts leave no KV behind and open no new
process group per transfer. (The pool's kill tests are in test_migration.py.)"""

import pytest

from tests.integration.conftest import FORCED_TRANSPORTS as FORCED
from tests.integration.helpers import complete, metrics_url, router_sample, scrape
from tests.integration.http_client import HTTP
from tests.integration.kv_stress import abort_fifty_requests
from tests.integration.processes import worker_pids
from tests.integration.prompts import DISAGGREGATED_MAX_TOKENS, DISAGGREGATED_PROMPTS, long_prompt
from tests.kv_faults import set_fault
from tests.waiting import wait_for

# Two prompts per transport in round-robin order: a short one (at most just past one 128-token
# KV block) and one of 2-6 blocks (test_disaggregation.py takes all, to ~1.5K tokens, on shm).
PAIR_PROMPTS = DISAGGREGATED_PROMPTS[:6]
CARRIED_BY = {"grpc", "gloo", "shm"}  # what the decode worker labels them (nccl is gloo on CPU)
# One KV block or less (128 tokens on CPU): no prefix-cache block is ever shared, so each
# request's KV comes whole from its prefill worker, and a fault test stays short.
FAULT_PROMPTS = [f"Note {i}. " + long_prompt(60) for i in range(len(FORCED))]
FAULT_MAX_TOKENS = 6
CAUGHT_AS = {
    "corrupt": "digest",
    "truncate": "length",
    "duplicate": "duplicate",
    "reorder": "order",
    "stale": "stale",
}


def failed_transfers(server) -> dict[str, float]:
    """The router's failed KV transfers so far, by the prefill worker's transport."""
    return {
        kind: router_sample(
            server, f'pdserve_kv_transfers_total{{outcome="failed",transport="{kind}"}}'
        )
        for kind in FORCED
    }


def test_each_pair_uses_its_transport_and_the_output_equals_vllms(mixed_pool, offline_reference):
    server = mixed_pool()
    failed_before = failed_transfers(server)
    carried: dict[str, set[str]] = {}
    for index, prompt in enumerate(PAIR_PROMPTS):
        response = complete(server, prompt, "disaggregated", DISAGGREGATED_MAX_TOKENS)
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
    metrics = HTTP.get(f"{server.url}/metrics", timeout=10).text
    for kind in FORCED:
        assert f'pdserve_kv_transfers_total{{outcome="loaded",transport="{kind}"}}' in metrics
    assert failed_transfers(server) == failed_before


@pytest.fixture(scope="module")
def local_outputs(mixed_pool) -> dict[str, str]:
    """Each fault prompt's greedy output on the local path (the decode worker prefills it)."""
    server = mixed_pool()
    return {
        prompt: complete(server, prompt, "local", FAULT_MAX_TOKENS).json()["choices"][0]["text"]
        for prompt in FAULT_PROMPTS
    }


def integrity_failures(server) -> dict[tuple[str, str], float]:
    """The decode workers' pdserve_kv_integrity_failures_total, by (transport, kind)."""
    counts: dict[tuple[str, str], float] = {}
    for decode in (w for w in server.workers() if w["role"] == "decode"):
        for series, value in scrape(metrics_url(server, "decode", decode["address"])).items():
            if series.startswith("pdserve_kv_integrity_failures_total{"):
                labels = dict(
                    part.split("=") for part in series.split("{", 1)[1].rstrip("}").split(",")
                )
                key = labels["transport"].strip('"'), labels["kind"].strip('"')
                counts[key] = counts.get(key, 0) + value
    return counts


def caught_since(server, before: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    after = integrity_failures(server)
    caught = {key: after[key] - before.get(key, 0) for key in after}
    return {key: count for key, count in caught.items() if count}


def one_round(server, local_outputs) -> set[str]:
    """Each fault prompt once, through the next prefill worker: the output must be the local
    path's (or, were the policy fail, a clean error); the transports that carried them."""
    carried = set()
    for prompt in FAULT_PROMPTS:
        response = complete(server, prompt, "disaggregated", FAULT_MAX_TOKENS)
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
def fault(mixed_pool, request):
    """Sets the test's fault kind on every prefill worker (rate 1), and none after it."""
    server = mixed_pool()
    set_fault(server.log_dir, f"{request.param}:1")
    yield request.param
    set_fault(server.log_dir, "")


def test_without_faults_every_transfer_loads_and_nothing_is_counted(mixed_pool, local_outputs):
    server = mixed_pool()
    before = integrity_failures(server)
    assert one_round(server, local_outputs) == set(FORCED)
    blocks_back_to_baseline(server)
    assert caught_since(server, before) == {}


@pytest.mark.parametrize("fault", [*CAUGHT_AS, "delay"], indirect=True)
def test_an_injected_fault_is_caught_on_every_transport_and_the_output_stays_right(
    mixed_pool, local_outputs, fault
):
    server = mixed_pool()
    before = integrity_failures(server)
    assert one_round(server, local_outputs) == set(FORCED)
    # A stale slice is one kept from the sending channel's transfer before (a channel: a
    # prefill rank -> a decode rank); with two decode workers a prefill worker's next transfer
    # may go to the other one, so rounds go on until each transport has revisited a channel
    # (the third, in round-robin order).
    stale = {(transport, CAUGHT_AS["stale"]) for transport in CARRIED_BY}
    for _ in range(3 if fault == "stale" else 0):
        if caught_since(server, before).keys() >= stale:
            break
        assert one_round(server, local_outputs) == set(FORCED)
    blocks_back_to_baseline(server)
    caught = caught_since(server, before)
    if fault == "delay":  # late, not wrong: nothing to catch
        assert caught == {}
    else:
        assert caught == {(transport, CAUGHT_AS[fault]): 1 for transport in CARRIED_BY}


def gloo_groups_opened(server) -> int:
    """How many KV gloo groups the decode workers have joined (their logs say each)."""
    logs = server.log_dir.glob("decode-*.log")
    return sum(log.read_text().count("KV gloo group with") for log in logs)


def test_fifty_aborts_leave_no_kv_behind_and_reuse_the_process_groups(mixed_pool):
    server = mixed_pool()
    groups_before = gloo_groups_opened(server)
    abort_fifty_requests(server)
    groups = gloo_groups_opened(server)
    # One pairwise group per channel (the nccl prefill rank -> a decode rank), reused by every
    # transfer: the aborts' nccl transfers (a dozen or so) open at most each channel's first.
    channels = len(worker_pids(server, "decode"))
    assert groups >= 1 and groups - groups_before <= 2 * channels, (groups_before, groups)
