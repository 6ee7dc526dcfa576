"""The host KV pool (kv_transfer/pool_store.py) on a real cluster: `pdserve serve --colocated
--workers 2` with its pool and round-robin routing, so a conversation's next turn lands on the
worker that did not compute its history.

That turn loads the history from the pool (the worker's pool-hit counter and the response's
cached tokens say how much) and answers exactly as vLLM's offline engine; the router's copy of
the pool's contents follows what the store holds (its stores, its evictions, its death); a
block whose bytes were damaged in the pool is refused, counted and recomputed, never used; a
workload larger than the pool stays within its byte budget; and killing the pool's store under
load fails no request (the workers compute what they would have loaded).
"""

import asyncio
import os
import signal

import httpx
import pytest

from kv_transfer.pool_client import PoolClient
from tests.integration.conftest import SERVED_MODEL, _stop_and_check, start_server
from tests.integration.http_client import HTTP
from tests.integration.processes import command_line, descendants
from tests.integration.prompts import (
    DISAGGREGATED_MAX_TOKENS,
    DISAGGREGATED_PROMPTS,
    POOL_FAULT_PROMPT,
    POOL_MAX_TOKENS,
    POOL_TURNS,
)
from tests.integration.test_worker_observability import metrics_url, scrape
from tests.waiting import wait_for

POOL_GIB = 0.1  # 18 SmolLM2 blocks (128 tokens of float32 KV: 5.6 MiB); the tests store ~26
BLOCK_TOKENS = 128
HISTORY_BLOCKS = 7  # POOL_TURNS[0] and POOL_FAULT_PROMPT: ~970 tokens


@pytest.fixture(scope="module")
def pooled(smollm2_dir, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("kv-pool"),
        "--colocated",
        "--workers",
        "2",
        "--policy",
        "round-robin",
        "--kv-pool-gib",
        str(POOL_GIB),
    )
    yield server
    _stop_and_check(server)


def complete(server, prompt: str, max_tokens: int = POOL_MAX_TOKENS) -> dict:
    reply = HTTP.post(
        f"{server.base_url}/completions",
        json={"model": SERVED_MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def worker_samples(server) -> list[dict[str, float]]:
    return [scrape(metrics_url(server, "colocated", row["address"])) for row in server.workers()]


def pool_hits(server) -> list[float]:
    """Each worker's prompt tokens loaded from the pool."""
    return [s.get('pdserve_kv_pool_hits_total{tier="host"}', 0.0) for s in worker_samples(server)]


def pool(server, name: str) -> float:
    """One of the pool's own series (both workers export the same store's figures)."""
    (samples, *_) = worker_samples(server)
    return samples[f'pdserve_kv_pool_{name}{{tier="host"}}']


def offload(server, name: str) -> list[float]:
    """Each worker's vLLM series vllm:kv_offload_NAME_total (its engine's pool loads and stores,
    as pdserve's PoolWorker reports them to vLLM's OffloadingConnector)."""
    return [
        sum(v for k, v in samples.items() if k.startswith(f"vllm:kv_offload_{name}_total{{"))
        for samples in worker_samples(server)
    ]


def store_pid(server) -> int:
    (pid,) = [
        pid
        for pid in descendants(server.process.pid)
        if "kv_transfer.pool_store" in command_line(pid)
    ]
    return pid


def stored_blocks(server) -> int:
    return int(pool(server, "blocks"))


def routers_copy(server) -> int:
    """The blocks the router's copy of the pool holds (router/pool_contents.py), what it prices
    loads on; 0 when it has none."""
    pools = HTTP.get(f"{server.url}/pdserve/workers", timeout=30).json()["kv_pools"]
    assert len(pools) <= 1, pools  # one host, one store
    return sum(row["blocks"] for row in pools)


def test_the_next_turn_on_the_other_worker_loads_the_history_and_answers_the_same(
    pooled, offline_reference
):
    expected = offline_reference["pool"]
    before, bytes_before = pool_hits(pooled), offload(pooled, "load_bytes")
    first = complete(pooled, POOL_TURNS[0])
    assert first["choices"][0]["text"] == expected[0]["text"]
    wait_for(lambda: stored_blocks(pooled) >= HISTORY_BLOCKS, 30, "the first turn's blocks stored")
    wait_for(lambda: routers_copy(pooled) >= HISTORY_BLOCKS, 10, "the router's copy of the pool")
    second = complete(pooled, POOL_TURNS[1])  # round-robin: the other worker
    assert second["choices"][0]["text"] == expected[1]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= HISTORY_BLOCKS * BLOCK_TOKENS
    gained = [after - was for after, was in zip(pool_hits(pooled), before, strict=True)]
    assert sorted(gained) == [0, cached], f"pool hits per worker: {gained}"
    # vLLM's own transfer series count the same load, in the pool's block size
    block_bytes = pool(pooled, "bytes") / pool(pooled, "blocks")
    loaded = offload(pooled, "load_bytes")
    loaded = [after - was for after, was in zip(loaded, bytes_before, strict=True)]
    assert sorted(loaded) == [0, cached / BLOCK_TOKENS * block_bytes], loaded
    # what a load took per token, which the routers weigh against computing one (its Stats)
    load_per_token = 'pdserve_kv_pool_load_seconds_per_token{tier="host"}'

    def once_a_load_is_timed() -> list[dict] | None:
        samples = worker_samples(pooled)
        return samples if max(w[load_per_token] for w in samples) > 0 else None

    samples = wait_for(once_a_load_is_timed, 10, "the loading worker's load time per token")
    loads = sorted(w[load_per_token] for w in samples)
    compute = max(w["pdserve_worker_prefill_seconds_per_token"] for w in samples)
    assert loads[0] == 0 and 0 < loads[1] < compute / 10, (loads, compute)


def test_a_damaged_block_in_the_pool_is_dropped_counted_and_recomputed(pooled, offline_reference):
    expected = offline_reference["pool"][2]
    first = complete(pooled, POOL_FAULT_PROMPT)  # computed and stored by one worker
    assert first["choices"][0]["text"] == expected["text"]
    wait_for(
        lambda: pool(pooled, "dropped_total") == 0 and stored_blocks(pooled) >= 2 * HISTORY_BLOCKS,
        30,
        "the prompt's blocks stored",
    )
    damage_every_slot(pooled)
    again = complete(pooled, POOL_FAULT_PROMPT)  # the other worker: loads, refuses, computes
    assert again["choices"][0]["text"] == expected["text"]
    assert pool(pooled, "dropped_total") >= HISTORY_BLOCKS


def damage_every_slot(server) -> None:
    """Flip a byte in every slot of the pool's memory, as a client of the store would see it
    (the store hands its memory to any client of the workers' namespace)."""
    address = store_address(server)
    stats = PoolClient(address, namespace=None).call("stats")
    client = PoolClient(address, stats["namespace"], stats["slot_bytes"])
    assert client.connected()
    for slot in range(client.slots):
        client.memory[client.header_bytes + slot * client.slot_bytes + 1000] ^= 0xFF
    client.close()


def store_address(server) -> str:
    """The store's address, from its command line (`--address @name`)."""
    words = command_line(store_pid(server))
    return words[words.index("--address") + 1]


def test_a_workload_larger_than_the_pool_stays_within_its_budget(pooled, offline_reference):
    for prompt, expected in zip(
        DISAGGREGATED_PROMPTS, offline_reference["disaggregated"], strict=True
    ):
        reply = complete(pooled, prompt, DISAGGREGATED_MAX_TOKENS)
        assert reply["choices"][0]["text"] == expected["text"]
    capacity = pool(pooled, "capacity_bytes")
    assert capacity <= POOL_GIB * 2**30
    wait_for(lambda: pool(pooled, "evictions_total") > 0, 30, "blocks evicted to make room")
    assert pool(pooled, "bytes") <= capacity
    # the router's copy follows the evictions: it holds what the store holds
    wait_for(
        lambda: routers_copy(pooled) == stored_blocks(pooled), 10, "the copy equal to the store"
    )


def test_killing_the_store_under_load_fails_no_request(pooled, offline_reference):
    """Six requests at once; the store is killed once one of them has been answered (the others
    are then being computed, stored or loaded): every request is answered, as vLLM would."""
    prompts = [f"Request {i}. " + POOL_TURNS[i % 2] for i in range(6)]
    victim = store_pid(pooled)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [
                asyncio.create_task(
                    client.post(
                        f"{pooled.base_url}/completions",
                        json={
                            "model": SERVED_MODEL,
                            "prompt": prompt,
                            "temperature": 0,
                            "max_tokens": POOL_MAX_TOKENS,
                        },
                    )
                )
                for prompt in prompts
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            os.kill(victim, signal.SIGKILL)
            return [await task for task in tasks]

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * len(prompts), [r.text for r in replies]
    again = complete(pooled, POOL_TURNS[0])
    assert again["choices"][0]["text"] == offline_reference["pool"][0]["text"]
    assert all('pdserve_kv_pool_bytes{tier="host"}' not in s for s in worker_samples(pooled))
    wait_for(lambda: routers_copy(pooled) == 0, 10, "the router's copy of a dead store dropped")
