"""The KV pool (kv_transfer/pool/store.py) on a real cluster: `pdserve serve --colocated
--workers 2 --kv-pool-scope worker`, a pool beside each worker as in Kubernetes (two hosts'
pools, as far as the workers can tell), with round-robin routing, so a conversation's next turn
lands on the worker that did not compute its history.

That turn's worker fetches the history from the other worker's pool into its own over gRPC (the
router named it: router/workers/choice.py's pool_fetch; pdserve/worker/pool_peers.py) and its
engine loads it from there (the worker's pool-hit counters and the response's cached tokens say
how much) and answers exactly as vLLM's offline engine; the router's copy of each pool's
contents follows what its store holds (its stores, its evictions, its death); blocks whose
bytes do not match their digest are refused by the engine, counted and recomputed, never used;
a workload larger than the pools stays within their byte budgets; and killing the stores under
load fails no request (the workers compute what they would have loaded).
"""

import asyncio
import os
import signal

import httpx
import pytest

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.copy import PoolMemory, key_tag
from kv_transfer.pool.wire import PEER, CompleteStore, PrepareStore
from pdserve.core.pool_keys import block_keys
from tests.integration.conftest import SERVED_MODEL, _stop_and_check, start_server
from tests.integration.helpers import first_parent, metrics_url, scrape
from tests.integration.http_client import HTTP
from tests.integration.processes import command_line, descendants
from tests.integration.prompts import (
    DISAGGREGATED_MAX_TOKENS,
    DISAGGREGATED_PROMPTS,
    POOL_FAULT_PROMPT,
    POOL_MAX_TOKENS,
    POOL_TURNS,
)
from tests.waiting import wait_for

POOL_GIB = 0.1  # 18 SmolLM2 blocks (128 tokens of float32 KV: 5.6 MiB) a pool; the tests store ~26
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
        "--kv-pool-scope",
        "worker",
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


def pool_hits(server, tier: str = "host") -> list[float]:
    """Each worker's prompt tokens loaded from its pool (host), or fetched into it from the
    other's (peer)."""
    name = f'pdserve_kv_pool_hits_total{{tier="{tier}"}}'
    return [samples.get(name, 0.0) for samples in worker_samples(server)]


def pools(server, name: str) -> list[float]:
    """One of the pools' own series, each worker's (its own pool's)."""
    return [s[f'pdserve_kv_pool_{name}{{tier="host"}}'] for s in worker_samples(server)]


def offload(server, name: str) -> list[float]:
    """Each worker's vLLM series vllm:kv_offload_NAME_total (its engine's pool loads and stores,
    as pdserve's PoolWorker reports them to vLLM's OffloadingConnector)."""
    return [
        sum(v for k, v in samples.items() if k.startswith(f"vllm:kv_offload_{name}_total{{"))
        for samples in worker_samples(server)
    ]


def store_pids(server) -> list[int]:
    return [
        pid
        for pid in descendants(server.process.pid)
        if "kv_transfer.pool.store" in command_line(pid)
    ]


def stored_blocks(server) -> int:
    return int(sum(pools(server, "blocks")))


def routers_copy(server) -> int:
    """The blocks the router's copies of the pools hold (router/workers/kv_pool_contents.py), what
    it prices loads and fetches on; 0 when it has none."""
    copies = HTTP.get(f"{server.url}/pdserve/workers", timeout=30).json()["kv_pools"]
    assert len(copies) <= 2, copies  # a pool per worker
    return sum(row["blocks"] for row in copies)


def test_the_next_turn_on_the_other_worker_fetches_the_history_and_answers_the_same(
    pooled, offline_reference
):
    expected = offline_reference["pool"]
    before, fetched_before = pool_hits(pooled), pool_hits(pooled, "peer")
    bytes_before = offload(pooled, "load_bytes")
    first = complete(pooled, POOL_TURNS[0])
    assert first["choices"][0]["text"] == expected[0]["text"]
    wait_for(lambda: stored_blocks(pooled) >= HISTORY_BLOCKS, 30, "the first turn's blocks stored")
    wait_for(lambda: routers_copy(pooled) >= HISTORY_BLOCKS, 10, "the router's copy of the pool")
    second = complete(pooled, POOL_TURNS[1])  # round-robin: the other worker, the other pool
    assert second["choices"][0]["text"] == expected[1]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= HISTORY_BLOCKS * BLOCK_TOKENS
    gained = [after - was for after, was in zip(pool_hits(pooled), before, strict=True)]
    assert sorted(gained) == [0, cached], f"pool hits per worker: {gained}"
    loader = gained.index(cached)
    fetched = [a - b for a, b in zip(pool_hits(pooled, "peer"), fetched_before, strict=True)]
    assert fetched[loader] == cached and fetched[1 - loader] == 0, fetched
    # vLLM's own transfer series count the same load, in the pool's block size
    block_bytes = pools(pooled, "bytes")[loader] / pools(pooled, "blocks")[loader]
    loaded = offload(pooled, "load_bytes")
    loaded = [after - was for after, was in zip(loaded, bytes_before, strict=True)]
    assert sorted(loaded) == [0, cached / BLOCK_TOKENS * block_bytes], loaded
    # what a fetch and a load took per token, which the routers weigh against computing one
    per_token = "pdserve_kv_pool_load_seconds_per_token"

    def once_timed() -> dict | None:
        samples = worker_samples(pooled)[loader]
        return samples if samples[f'{per_token}{{tier="host"}}'] > 0 else None

    samples = wait_for(once_timed, 10, "the loading worker's load time per token")
    load = samples[f'{per_token}{{tier="host"}}']
    fetch = samples[f'{per_token}{{tier="peer"}}']
    compute = max(w["pdserve_worker_prefill_seconds_per_token"] for w in worker_samples(pooled))
    # the fetch is measured (its speed on a loaded CI host varies: the router prices it as it is)
    assert 0 < load < compute / 10 and fetch > 0, (load, fetch, compute)


def test_blocks_that_fail_their_digest_are_refused_counted_and_recomputed(
    pooled, offline_reference
):
    """Blocks of a prompt no worker computed yet, written into both pools with their right key
    and wrong bytes (as a writer dying mid-copy, or damaged memory, would leave them): whichever
    worker gets the prompt finds them in its pool, its engine refuses them on their digest,
    they are dropped and counted, and the prompt is computed."""
    expected = offline_reference["pool"][2]
    token_ids = HTTP.post(
        f"{pooled.url}/tokenize",
        json={"model": SERVED_MODEL, "prompt": POOL_FAULT_PROMPT},
        timeout=30,
    ).json()["tokens"]
    keys = list(block_keys(token_ids, BLOCK_TOKENS, first_parent(pooled)))
    assert len(keys) >= HISTORY_BLOCKS
    for address in store_addresses(pooled):
        write_damaged(address, keys)
    dropped_before = sum(pools(pooled, "dropped_total"))
    again = complete(pooled, POOL_FAULT_PROMPT)
    assert again["choices"][0]["text"] == expected["text"]
    assert sum(pools(pooled, "dropped_total")) - dropped_before >= len(keys)


def write_damaged(address: str, keys: list[bytes]) -> None:
    """Store `keys` in the pool at `address` as loadable, each slot's header naming its key and
    a digest its bytes do not have (the store hands its memory to any client of its user)."""
    client = PoolClient(address, PEER)
    assert client.connected()
    stored = client.call(PrepareStore(tuple(keys))).stored
    assert list(stored.keys) == keys, "a key was stored already"
    memory = PoolMemory.over(client.memory, client.header_bytes, client.slots, client.parts)
    for key, slot in zip(keys, stored.slots, strict=True):
        memory.slots[slot].fill_(7)
        for part in range(client.parts):
            memory.headers[slot, part, 0] = key_tag(key)
            memory.headers[slot, part, 1] = 12345
    client.call(CompleteStore(tuple(keys), success=True))
    client.close()


def store_addresses(server) -> list[str]:
    """The workers' pools' addresses (`--address @name` on each store's command line)."""
    addresses = []
    for pid in store_pids(server):
        words = command_line(pid)
        addresses.append(words[words.index("--address") + 1])
    assert sorted(addresses) == sorted(row["kv_pool"] for row in server.workers())
    return addresses


def test_a_workload_larger_than_the_pools_stays_within_their_budgets(pooled, offline_reference):
    for prompt, expected in zip(
        DISAGGREGATED_PROMPTS, offline_reference["disaggregated"], strict=True
    ):
        reply = complete(pooled, prompt, DISAGGREGATED_MAX_TOKENS)
        assert reply["choices"][0]["text"] == expected["text"]
    capacities = pools(pooled, "capacity_bytes")
    assert max(capacities) <= POOL_GIB * 2**30
    wait_for(lambda: sum(pools(pooled, "evictions_total")) > 0, 30, "blocks evicted for room")
    assert all(used <= cap for used, cap in zip(pools(pooled, "bytes"), capacities, strict=True))
    # the router's copies follow the evictions: they hold what the stores hold
    wait_for(
        lambda: routers_copy(pooled) == stored_blocks(pooled), 10, "the copies equal the stores"
    )


def test_killing_the_stores_under_load_fails_no_request(pooled, offline_reference):
    """Six requests at once; both stores are killed once one of them has been answered (the
    others are then being computed, stored, fetched or loaded): every request is answered, as
    vLLM would."""
    prompts = [f"Request {i}. " + POOL_TURNS[i % 2] for i in range(6)]
    victims = store_pids(pooled)
    assert len(victims) == 2

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
            for victim in victims:
                os.kill(victim, signal.SIGKILL)
            return [await task for task in tasks]

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * len(prompts), [r.text for r in replies]
    again = complete(pooled, POOL_TURNS[0])
    assert again["choices"][0]["text"] == offline_reference["pool"][0]["text"]
    assert all('pdserve_kv_pool_bytes{tier="host"}' not in s for s in worker_samples(pooled))
    wait_for(lambda: routers_copy(pooled) == 0, 10, "the router's copies of dead stores dropped")
