"""Prefill on the prefill worker, KV over shared memory (`auto` on one host), decode on the
decode worker: the real thing.

Outputs are compared with vLLM's offline engine, which computes every prompt itself (the
colocated truth). Each disaggregated prompt is sent here first, so the decode worker holds no
prefix of it: its count of tokens it did not compute is then exactly what it received.
"""

import pytest

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import PEER, Lookup
from pdserve.core.pool_keys import block_keys
from tests.integration.conftest import router_over
from tests.integration.helpers import (
    complete,
    complete_at,
    first_parent,
    metrics_url,
    router_total,
    scrape,
)
from tests.integration.http_client import HTTP
from tests.integration.prompts import (
    DECODE_POOL_CONVERSATIONS,
    DISAGGREGATED_PROMPTS,
    POOL_MAX_TOKENS,
    long_prompt,
)
from tests.waiting import wait_for

LOADS = 'pdserve_worker_kv_transfer_loads_total{{when="{}"}}'
IN_STEP, STEP_BEFORE = LOADS.format("in_step"), LOADS.format("step_before")


def loads(metrics: str) -> tuple[float, float]:
    """The decode worker's KV loads so far: (in the request's step, in a step before it)."""
    values = scrape(metrics)
    return values.get(IN_STEP, 0.0), values.get(STEP_BEFORE, 0.0)


@pytest.mark.parametrize("index", range(len(DISAGGREGATED_PROMPTS)))
def test_disaggregated_output_equals_colocated_and_skips_the_prompt(
    server, offline_reference, index
):
    """The colocated answer, none of the prompt computed on the decode worker, its KV loaded
    once (in the request's step where it had all arrived, else in a step before)."""
    decode_metrics = metrics_url(server, "decode", server.worker("decode")["address"])
    in_step, step_before = loads(decode_metrics)
    fallbacks_before = router_total(server, "pdserve_kv_fallbacks_total")
    response = complete(server, DISAGGREGATED_PROMPTS[index], "disaggregated")
    assert response.status_code == 200, response.text
    body = response.json()
    expected = offline_reference["disaggregated"][index]
    assert body["choices"][0]["text"] == expected["text"]
    assert body["usage"]["completion_tokens"] == len(expected["token_ids"])
    # Routed as asked, prefilled on the prefill worker...
    assert response.headers["x-pdserve-route"] == "disaggregated"
    assert response.headers["x-pdserve-prefill-worker"].startswith("prefill@")
    assert response.headers["x-pdserve-worker"].startswith("decode@")
    assert body["usage"]["completion_tokens"] > 1, "the decode worker must have had work"
    # ...and the decode worker computed none of the prompt: vLLM counted every prompt token
    # as already there (received KV), and nothing fell back to local prefill.
    assert int(response.headers["x-pdserve-decode-cached-tokens"]) == body["usage"]["prompt_tokens"]
    assert router_total(server, "pdserve_kv_fallbacks_total") == fallbacks_before
    timing = body["pdserve_timing"]
    blocks = -(-body["usage"]["prompt_tokens"] // 128)
    assert timing["kv_bytes"] == blocks * 30 * 3 * 128 * 2 * 64 * 4
    assert timing["prefill"] > 0 and timing["first_decode_step"] > 0
    # The hand-off, measured: after the first token and within what the client waited.
    assert 0 < timing["first_to_second_token"]
    assert timing["ttft"] + timing["first_to_second_token"] < response.elapsed.total_seconds()
    assert timing["kv_transport"] == "shm"  # what `auto` picks for two CPU workers on one host
    wait_for(lambda: sum(loads(decode_metrics)) == in_step + step_before + 1, 10, "one KV load")


def test_kv_that_arrived_before_its_request_loads_in_the_requests_step(server):
    """No engine step for the hand-off: the router sends the decode leg once the prefill worker
    returned the first token, by when a short prompt's KV is (almost always) at the decode
    worker's rank, and its scheduler half, told so by the rank (decode_workers/arrivals.py),
    loads it in the step that schedules the request (counted `in_step`). A long prompt's last
    slices may still be on their way then: that load comes a step before its request's (the
    asynchronous path), so of three fresh short prompts at least one must load in its step."""
    decode_metrics = metrics_url(server, "decode", server.worker("decode")["address"])
    in_step, step_before = loads(decode_metrics)
    for index in range(3):
        prompt = f"Fresh prompt {index} for the hand-off: " + long_prompt(40)
        response = complete(server, prompt, "disaggregated")
        assert response.status_code == 200, response.text
        assert int(response.headers["x-pdserve-decode-cached-tokens"]) > 0
    wait_for(lambda: sum(loads(decode_metrics)) == in_step + step_before + 3, 10, "three loads")
    assert loads(decode_metrics)[0] > in_step, "no KV loaded in its request's step"


def test_an_unforced_request_takes_the_path_its_estimate_names(server):
    """The default route policy prices every path from the workers' live state and learned
    step costs (which path is cheapest for given prices: tests/unit/test_route_choice.py); the
    decision comes back in the timing breakdown, the request was served the way it names (a
    prefill worker's KV fills the decode worker's prompt, or the decode worker computes it all),
    and decisions are counted by path and reason."""
    for prompt, floor_bars_disaggregation in (
        ("Hi", True),
        (DISAGGREGATED_PROMPTS[4] + " Again?", False),
    ):
        response = complete(server, prompt, route="")
        assert response.status_code == 200, response.text
        body = response.json()
        decision = body["pdserve_timing"]["decision"]
        assert decision["reason"] == "estimate"
        costs = decision["costs"]
        assert ("disaggregated" not in costs) == floor_bars_disaggregation
        assert "local" in costs and "stay-on-prefill" not in costs  # the decode worker has room
        assert all(cost["ttft_s"] > 0 and cost["decode_s"] > 0 for cost in costs.values())
        assert response.headers["x-pdserve-route"] == decision["route"]
        assert response.headers["x-pdserve-worker"].startswith("decode@")
        prompt_tokens = body["usage"]["prompt_tokens"]
        received = int(response.headers["x-pdserve-decode-cached-tokens"])
        if decision["route"] == "disaggregated":
            assert response.headers["x-pdserve-prefill-worker"].startswith("prefill@")
            assert received == prompt_tokens
        else:
            assert "x-pdserve-prefill-worker" not in response.headers
            assert received < prompt_tokens  # the decode worker computed the prompt's tail
    metrics = HTTP.get(f"{server.url}/metrics", timeout=10).text
    assert 'pdserve_route_decisions_total{path="' in metrics and 'reason="estimate"' in metrics


def test_the_workers_report_the_step_costs_they_learned(server):
    """By now both workers have computed prompts and decoded: /pdserve/workers shows what each
    learned, the figures the route estimate uses."""
    for route in ("disaggregated", "local"):
        assert complete(server, DISAGGREGATED_PROMPTS[5], route).status_code == 200
    rows = HTTP.get(f"{server.url}/pdserve/workers", timeout=10).json()["workers"]
    learned = {row["role"]: row for row in rows}
    assert learned["prefill"]["prefill_seconds_per_token"] > 0
    assert learned["decode"]["prefill_seconds_per_token"] > 0
    assert learned["decode"]["decode_step_base_seconds"] > 0
    assert learned["decode"]["decode_step_seconds_per_sequence"] > 0


def test_a_bad_route_header_is_refused(server):
    response = complete(server, "Hi", route="sideways")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-pdserve-route"


def test_cached_tokens_come_from_the_prefill_workers_cache(server):
    prompt = "A prompt no worker has seen: " + long_prompt(700)
    first = complete(server, prompt, "disaggregated").json()
    again = complete(server, prompt, "disaggregated").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The prefill worker now holds the prompt's full blocks in its prefix cache.
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= again["usage"]["prompt_tokens"] and cached % 128 == 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def first_two_token_texts(server, prompt: str) -> list[str]:
    """The texts of the prompt's first two greedy tokens, from their logprobs (a stream's
    chunks need not be one token each: the engine merges tokens a slow reader has not taken)."""
    reply = complete(server, prompt, "local", max_tokens=2, logprobs=1).json()
    return reply["choices"][0]["logprobs"]["tokens"]


@pytest.mark.parametrize("extra", [{"seed": 11}, {}], ids=["seeded", "greedy"])
def test_a_stop_string_across_the_first_two_tokens_is_honoured(server, extra):
    prompt = "A stop string check: " + long_prompt(300)
    first, second = first_two_token_texts(server, prompt)
    stop = first[-2:] + second[:2]
    results = [
        complete(server, prompt, route, stop=[stop], max_tokens=8, **extra).json()
        for route in ("local", "disaggregated")
    ]
    local, disaggregated = (r["choices"][0] for r in results)
    assert local["finish_reason"] == "stop" and stop not in local["text"]
    assert (disaggregated["text"], disaggregated["finish_reason"]) == (
        local["text"],
        local["finish_reason"],
    )


BLOCK_BYTES = 30 * 3 * 128 * 2 * 64 * 4  # SmolLM2's KV of one 128-token block, float32


def test_a_cache_aware_router_sends_only_the_blocks_the_decode_worker_lacks(server, tmp_path):
    """A conversation's next turn through a cache-aware router over the same two workers: the
    decode worker received the turn before, so the prefill worker sends only the blocks after
    it. The answer equals the one for which every block was sent (through this cluster's own
    round-robin router), and the decode worker still computes none of the prompt."""
    addresses = [server.worker("prefill")["address"], server.worker("decode")["address"]]
    history = DISAGGREGATED_PROMPTS[5]
    turn = history + " " + DISAGGREGATED_PROMPTS[1]
    every_block = complete(server, turn, "disaggregated")
    assert every_block.status_code == 200, every_block.text
    with router_over(addresses, tmp_path, policy="cache-aware") as url:
        first = complete_at(f"{url}/v1", history, "disaggregated")
        assert first.status_code == 200, first.text
        held = first.json()["usage"]["prompt_tokens"]
        response = complete_at(f"{url}/v1", turn, "disaggregated")
    assert response.status_code == 200, response.text
    body, full = response.json(), every_block.json()
    assert body["choices"][0]["text"] == full["choices"][0]["text"]
    assert int(response.headers["x-pdserve-decode-cached-tokens"]) == body["usage"]["prompt_tokens"]
    sent, all_blocks = body["pdserve_timing"]["kv_bytes"], full["pdserve_timing"]["kv_bytes"]
    assert all_blocks == -(-body["usage"]["prompt_tokens"] // 128) * BLOCK_BYTES
    skipped = (all_blocks - sent) // BLOCK_BYTES
    assert sent % BLOCK_BYTES == 0 and skipped >= (held - 128) // 128, (held, skipped)


def pool_holds(server, token_ids: list[int], blocks: int) -> bool:
    """Whether the host KV pool's store holds the first `blocks` blocks of `token_ids`."""
    (address,) = {row["kv_pool"] for row in server.workers()}
    keys = list(block_keys(token_ids, 128, first_parent(server)))[:blocks]
    client = PoolClient(address, PEER)
    try:
        return client.call(Lookup(tuple(keys))).blocks == blocks
    finally:
        client.close()


def decode_pool_hits(server) -> float:
    """The prompt tokens the decode worker's engine loaded from the host KV pool."""
    url = metrics_url(server, "decode", server.worker("decode")["address"])
    return scrape(url).get('pdserve_kv_pool_hits_total{tier="host"}', 0.0)


def test_the_decode_worker_stores_its_answer_and_the_next_turns_prefill_worker_loads_it(
    server, offline_reference
):
    """The decode worker is in the host KV pool too: the blocks of a disaggregated turn it
    received and the answer it generated are stored there, so the next turn's prefill worker
    (which computed the prompt, never the answer) loads the block the answer completed instead
    of computing it, and answers as vLLM's offline engine."""
    expected = offline_reference["conversations"][0]
    hits = decode_pool_hits(server)
    first = complete(
        server,
        DECODE_POOL_CONVERSATIONS[0]["first"],
        "disaggregated",
        max_tokens=DECODE_POOL_CONVERSATIONS[0]["first_max_tokens"],
        return_token_ids=True,
    ).json()
    assert first["choices"][0]["text"] == expected["first"]["text"]
    assert decode_pool_hits(server) == hits  # what it received is not loaded from the pool
    prompt, answer = first["choices"][0]["prompt_token_ids"], first["choices"][0]["token_ids"]
    answered = (len(prompt) + len(answer) - 1) // 128  # the last token's KV is never stored
    assert answered == len(prompt) // 128 + 1, "the answer must complete a block"
    turn = expected["next"]["prompt_token_ids"]
    assert turn[: len(prompt) + len(answer)] == prompt + answer
    wait_for(lambda: pool_holds(server, turn, answered), 30, "the answer's block in the pool")
    response = complete(server, turn, "stay-on-prefill", max_tokens=POOL_MAX_TOKENS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == expected["next"]["text"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == answered * 128


def test_the_decode_worker_loads_from_the_pool_a_prompt_it_computes_itself(
    server, offline_reference
):
    """A conversation the prefill worker served whole (stay-on-prefill: the decode worker never
    saw it): its next turn on the local path is computed by the decode worker, which loads the
    history (the prompt and the answer) from the host KV pool and computes only the rest."""
    expected = offline_reference["conversations"][1]
    first = complete(
        server,
        DECODE_POOL_CONVERSATIONS[1]["first"],
        "stay-on-prefill",
        max_tokens=DECODE_POOL_CONVERSATIONS[1]["first_max_tokens"],
    ).json()
    assert first["choices"][0]["text"] == expected["first"]["text"]
    turn = expected["next"]["prompt_token_ids"]
    answered = expected["first"]
    history = (len(answered["prompt_token_ids"]) + len(answered["token_ids"]) - 1) // 128
    wait_for(lambda: pool_holds(server, turn, history), 30, "the history in the pool")
    hits = decode_pool_hits(server)
    response = complete(server, turn, "local", max_tokens=POOL_MAX_TOKENS)
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-worker"].startswith("decode@")
    body = response.json()
    assert body["choices"][0]["text"] == expected["next"]["text"]
    loaded = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert loaded == history * 128
    wait_for(lambda: decode_pool_hits(server) - hits == loaded, 10, "the decode worker's hits")
