"""Reuse across hosts (kv_transfer/pool/peer.py, pdserve/worker/pool_peers.py): two real host
KV pool stores, blocks computed into one by an engine's own copy code, and a worker of the other
host fetching them over real gRPC on loopback from the first host's worker service (no engine:
the service's ReadPoolBlocks needs only its pool).

What is fetched lands bit for bit and becomes loadable in the second pool, chunk by chunk; the
source's pins end with the call; a damaged block, a source that holds fewer blocks, is gone, is
hung or holds another model's blocks bring what they can and leave nothing half-written, within
the fetch's deadline, each counted by why.
"""

import asyncio
import os
import secrets
import signal
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from kv_transfer.pool import peer as pool_peer
from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.copy import PoolMemory, load_blocks, store_blocks
from kv_transfer.pool.wire import (
    CompleteLoad,
    CompleteStore,
    Found,
    Lookup,
    PrepareLoad,
    PrepareStore,
)
from pdserve.cluster.local_services import start_kv_pool
from pdserve.core.pool_keys import block_keys
from pdserve.protocol import GRPC_OPTIONS, worker_pb2, worker_pb2_grpc
from pdserve.worker import pool_peers
from pdserve.worker.engine_stats import EngineStats
from pdserve.worker.metrics_server import WorkerMetrics
from pdserve.worker.pool_peers import PoolPeers
from pdserve.worker.processes import free_port, stop_group
from pdserve.worker.service import WorkerService
from tests.waiting import wait_for

SLOT = 4096  # one block's bytes (two pages of 2 KiB, as a cache of two tensors)
SLOTS = 4
BLOCK_TOKENS = 16
NAMESPACE = "model x, layout y"
NONE_HASH = b"n" * 32
PROMPT = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))  # three whole blocks
KEYS = tuple(block_keys(PROMPT, BLOCK_TOKENS, NONE_HASH))


@pytest.fixture
def stores():
    """Two hosts' pools: their addresses; each store is stopped after the test."""
    addresses, processes = [], []
    for _ in range(2):
        address = f"@pdserve-kv-pool-test-{secrets.token_hex(4)}"
        log_path = Path(tempfile.mkdtemp(prefix="kv-pool-")) / "kv-pool.log"
        processes.append(start_kv_pool(log_path, SLOTS * SLOT, address)[1])
        addresses.append(address)
    yield addresses
    for process in processes:  # both told at once, then each waited for
        os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        stop_group(process.pid, process=process)


def engine(address: str, namespace: str = NAMESPACE) -> PoolClient:
    """An engine's connection, which sets what its pool holds."""
    client = PoolClient(address, namespace, SLOT)
    wait_for(client.connected, 10, "the store's hello")  # within its back-off, on a busy host
    return client


def memory(client: PoolClient) -> PoolMemory:
    return PoolMemory.over(client.memory, client.header_bytes, client.slots, client.parts)


def computed(client: PoolClient, blocks: int) -> list[torch.Tensor]:
    """An engine computes the prompt's first `blocks` blocks and stores them in its pool: its
    cache's pages (two tensors, a block a row)."""
    pages = [torch.randint(0, 256, (blocks, SLOT // 2), dtype=torch.uint8) for _ in range(2)]
    keys = KEYS[:blocks]
    slots = client.call(PrepareStore(keys)).stored.slots
    store_blocks(pages, list(range(blocks)), memory(client), slots, keys)
    client.call(CompleteStore(keys, success=True))
    return pages


def loaded(client: PoolClient, blocks: int) -> list[torch.Tensor]:
    """Another engine loads the prompt's first `blocks` blocks from its pool, checked."""
    pages = [torch.zeros((blocks, SLOT // 2), dtype=torch.uint8) for _ in range(2)]
    keys = KEYS[:blocks]
    slots = client.call(PrepareLoad(keys)).slots
    copied, refused, _ = load_blocks(pages, list(range(blocks)), memory(client), slots, keys)
    client.call(CompleteLoad(keys))
    assert not refused and copied == blocks * SLOT
    return pages


class Source:
    """The source host's worker: its gRPC service on 127.0.0.1, serving its pool."""

    def __init__(self, address: str):
        self.service = WorkerService("source", "colocated", "m", kv_pool=address)
        self.service.pool_peers = PoolPeers(address, BLOCK_TOKENS, NONE_HASH, EngineStats())
        self.address = f"127.0.0.1:{free_port()}"

    async def __aenter__(self) -> "Source":
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.service, self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(grace=None)
        await self.service.pool_peers.close()


def fetcher(address: str, prefill_s_per_token: float = 0.0) -> tuple[PoolPeers, WorkerMetrics]:
    """The fetching host's worker side, counting into its own registry."""
    stats = EngineStats()
    if prefill_s_per_token:
        stats.step_costs.finished_request(prefill_s_per_token * 1000, 1000, 0)
    metrics = WorkerMetrics(CollectorRegistry())
    return PoolPeers(address, BLOCK_TOKENS, NONE_HASH, stats, metrics), metrics


def failures(metrics: WorkerMetrics, reason: str) -> float:
    return metrics.kv_pool_fetch_failures.labels(reason)._value.get()


def fetch(peers: PoolPeers, source: str, tokens: int) -> int:
    async def run() -> int:
        try:
            return await peers.fetch(PROMPT, worker_pb2.PoolFetch(source=source, tokens=tokens))
        finally:
            await peers.close()

    return asyncio.run(run())


def test_fetched_blocks_land_bit_for_bit_chunk_by_chunk_and_the_sources_pins_end(
    stores, monkeypatch
):
    monkeypatch.setattr(pool_peer, "CHUNK_BYTES", 1000)  # a block in five chunks
    here, there = stores
    source_engine, fetching_engine = engine(there), engine(here)
    pages = computed(source_engine, 3)
    peers, metrics = fetcher(here)

    async def run() -> int:
        async with Source(there) as source:
            return await peers.fetch(
                PROMPT, worker_pb2.PoolFetch(source=source.address, tokens=3 * BLOCK_TOKENS)
            )

    assert asyncio.run(run()) == 3 * BLOCK_TOKENS
    assert fetching_engine.call(Lookup(KEYS)) == Found(3)
    got = loaded(fetching_engine, 3)
    assert all(torch.equal(a, b) for a, b in zip(pages, got, strict=True))
    assert metrics.kv_pool_hits.labels("peer")._value.get() == 3 * BLOCK_TOKENS
    assert peers.stats.pool_fetched_tokens == 3 * BLOCK_TOKENS
    assert peers.stats.pool_fetch_seconds_per_token() > 0
    # no pin outlives the call: the source's pool can replace all its blocks
    assert source_engine.call(PrepareStore((b"a", b"b", b"c", b"d"))).stored is not None


def test_a_damaged_block_is_never_loadable_and_what_came_before_it_is_kept(stores):
    here, there = stores
    source_engine, fetching_engine = engine(there), engine(here)
    computed(source_engine, 3)
    slot = source_engine.call(PrepareLoad(KEYS[1:2])).slots[0]
    source_engine.call(CompleteLoad(KEYS[1:2]))
    memory(source_engine).slots[slot, 7] ^= 0x10  # one bit of the second block, in memory
    peers, metrics = fetcher(here)

    async def run() -> int:
        async with Source(there) as source:
            return await peers.fetch(
                PROMPT, worker_pb2.PoolFetch(source=source.address, tokens=3 * BLOCK_TOKENS)
            )

    assert asyncio.run(run()) == BLOCK_TOKENS
    assert fetching_engine.call(Lookup(KEYS)) == Found(1)
    assert failures(metrics, "damaged") == 1
    # the damaged block's and the unsent block's slots were freed: four new blocks fit
    assert fetching_engine.call(PrepareStore((b"a", b"b", b"c"))).stored is not None


def test_a_source_holding_fewer_blocks_sends_those_and_only_missing_ones_are_asked(stores):
    here, there = stores
    source_engine, fetching_engine = engine(there), engine(here)
    computed(source_engine, 2)
    pages = computed(fetching_engine, 1)  # this pool has the first block already
    peers, metrics = fetcher(here)

    async def run() -> int:
        async with Source(there) as source:
            return await peers.fetch(
                PROMPT, worker_pb2.PoolFetch(source=source.address, tokens=3 * BLOCK_TOKENS)
            )

    assert asyncio.run(run()) == BLOCK_TOKENS  # the second block: the first was here
    assert fetching_engine.call(Lookup(KEYS)) == Found(2)
    assert torch.equal(loaded(fetching_engine, 1)[0], pages[0])  # not overwritten
    assert failures(metrics, "evicted") == 1


def test_a_source_that_is_gone_or_holds_another_models_blocks_brings_nothing(stores):
    here, there = stores
    fetching_engine = engine(here)
    computed(engine(there, "another model"), 2)
    peers, metrics = fetcher(here)
    assert fetch(peers, f"127.0.0.1:{free_port()}", 2 * BLOCK_TOKENS) == 0
    assert failures(metrics, "unreachable") == 1

    async def run() -> int:
        async with Source(there) as source:
            return await peers.fetch(
                PROMPT, worker_pb2.PoolFetch(source=source.address, tokens=2 * BLOCK_TOKENS)
            )

    assert asyncio.run(run()) == 0
    assert failures(metrics, "refused") == 1
    assert fetching_engine.call(Lookup(KEYS)) == Found(0)
    assert fetching_engine.call(PrepareStore((*KEYS, b"d"))).stored is not None


class HungSource(worker_pb2_grpc.WorkerServicer):
    """A fake source worker (named as one): it sends nothing and never ends its stream."""

    async def ReadPoolBlocks(self, request, context):
        await asyncio.sleep(3600)
        yield worker_pb2.PoolBlockChunk()


def test_a_hung_source_costs_what_computing_the_tokens_would_and_no_more(stores, monkeypatch):
    monkeypatch.setattr(pool_peers, "MIN_FETCH_S", 0.01)
    here, _there = stores
    fetching_engine = engine(here)
    prefill_s_per_token = 0.005  # the fetch's budget: 2 blocks of 16 tokens, 0.16 s
    peers, metrics = fetcher(here, prefill_s_per_token)

    async def run() -> tuple[int, float]:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        worker_pb2_grpc.add_WorkerServicer_to_server(HungSource(), server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        try:
            started = time.monotonic()
            fetched = await peers.fetch(
                PROMPT, worker_pb2.PoolFetch(source=address, tokens=2 * BLOCK_TOKENS)
            )
            return fetched, time.monotonic() - started
        finally:
            await peers.close()
            await server.stop(grace=None)

    fetched, took = asyncio.run(run())
    assert fetched == 0 and failures(metrics, "timeout") == 1
    assert 2 * BLOCK_TOKENS * prefill_s_per_token <= took < 2.0
    assert fetching_engine.call(PrepareStore((*KEYS, b"d"))).stored is not None
