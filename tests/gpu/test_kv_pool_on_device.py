"""The host KV pool's copy path (kv_transfer/pool/copy.py) between device caches and real store
processes: bit-exact for each tensor-parallel rank's part, a changed byte refused by its rank
alone, and a fetch between two hosts' pools that refuses a damaged block on arrival."""

import tempfile
import time
from pathlib import Path

import pytest
import torch

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.copy import PoolMemory, cache_rows, load_blocks, store_blocks
from kv_transfer.pool.peer import BlockWriter, Damaged, read_blocks
from kv_transfer.pool.wire import (
    PEER,
    CompleteLoad,
    CompleteStore,
    Drop,
    Lookup,
    PrepareLoad,
    PrepareStore,
)
from pdserve.cluster.local_services import start_kv_pool
from pdserve.worker.processes import stop_group
from tests.gpu.kv_caches import BLOCKS, as_bits, random_bytes

pytestmark = pytest.mark.gpu


@pytest.fixture
def kv_pools():
    """start(name, budget_bytes) -> a real store process's address; each stopped after the test."""
    stores = []

    def start(name: str, budget_bytes: int) -> str:
        log_path = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-")) / "kv-pool.log"
        address, store = start_kv_pool(log_path, budget_bytes)
        stores.append(store)
        return address

    yield start
    for store in stores:
        stop_group(store.pid, process=store)


def test_kv_pool_store_and_load_is_bit_exact_per_rank(device, kv_pools, record_property):
    """An engine of two tensor-parallel ranks: each rank's blocks of a bfloat16 and an fp8
    (uint8) cache on the device go into its part of the slots and come back bit for bit into
    another cache's blocks; a byte changed in one rank's part is refused by that rank alone (its
    block left as it was), and the other rank still loads its part."""
    page, ranks = 256 << 10, 2  # one block's bytes in each cache of a rank
    caches = [
        [random_bytes((BLOCKS, page // 2), torch.bfloat16, device)]
        + [random_bytes((BLOCKS, page), torch.uint8, device)]
        for _ in range(ranks)
    ]
    targets = [[torch.zeros_like(cache) for cache in rank] for rank in caches]
    keys = tuple(f"block {i}".encode() for i in range(4))
    sources, destinations = [1, 3, 5, 7], [0, 2, 4, 6]
    slot = ranks * 2 * page
    address = kv_pools("store", len(keys) * slot)
    writer = PoolClient(address, "gpu_check", slot, ranks)
    reader = PoolClient(address, "gpu_check", slot, ranks)
    try:
        slots = writer.call(PrepareStore(keys)).stored.slots
        memory = PoolMemory.over(writer.memory, writer.header_bytes, writer.slots, ranks)
        started = time.perf_counter()
        for rank, rank_caches in enumerate(caches):
            pages = [cache_rows(c) for c in rank_caches]
            store_blocks(pages, sources, memory, slots, keys, rank)
        stored_s = time.perf_counter() - started
        writer.call(CompleteStore(keys, success=True))
        loaded_slots = reader.call(PrepareLoad(keys)).slots
        memory = PoolMemory.over(reader.memory, reader.header_bytes, reader.slots, ranks)
        started = time.perf_counter()
        for rank, rank_targets in enumerate(targets):
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, destinations, memory, loaded_slots, keys, rank)
            assert not refused, f"rank {rank}: intact blocks refused: {refused}"
        loaded_s = time.perf_counter() - started
        for rank_caches, rank_targets in zip(caches, targets, strict=True):
            for cache, target in zip(rank_caches, rank_targets, strict=True):
                for source, destination in zip(sources, destinations, strict=True):
                    assert torch.equal(as_bits(cache[source]), as_bits(target[destination])), (
                        f"block {source} came back changed"
                    )
        memory.part(loaded_slots[0], 1)[5] ^= 1
        for rank, rank_targets in enumerate(targets):
            before = as_bits(rank_targets[0][1])
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, [1], memory, loaded_slots[:1], keys[:1], rank)
            if rank == 1:
                assert refused == [1], "a changed byte in rank 1's part was loaded"
                assert torch.equal(as_bits(rank_targets[0][1]), before), "a refused block moved"
            else:
                assert not refused, "rank 0 refused its intact part of a slot rank 1's changed in"
    finally:
        writer.close()
        reader.close()
    rate = len(keys) * slot / 1e9
    record_property(
        "detail",
        f"bit-exact for 2 ranks' parts, a changed byte refused by its rank alone; "
        f"store {rate / stored_s:.2f} GB/s, load {rate / loaded_s:.2f} GB/s (with the digest)",
    )


def test_a_fetch_between_hosts_pools_is_bit_exact_and_refuses_a_damaged_block(
    device, kv_pools, record_property
):
    """Blocks a 2-rank engine stored from its device caches into one store are read out of it,
    written into another store and checked there (kv_transfer/pool/peer.py; what two workers'
    gRPC carries between them is left out), and another 2-rank engine loads them onto the
    device bit for bit; a bit flipped in the first store's memory makes that block fail its
    check on arrival, and it never becomes loadable."""
    page, ranks = 256 << 10, 2
    caches = [[random_bytes((BLOCKS, page), torch.uint8, device)] for _ in range(ranks)]
    targets = [[torch.zeros_like(rank[0])] for rank in caches]
    keys = tuple(f"peer block {i}".encode() for i in range(4))
    blocks = [1, 3, 5, 7]
    slot = ranks * page
    addresses = [kv_pools(name, len(keys) * slot) for name in ("source", "destination")]
    engines = [PoolClient(address, "gpu_check", slot, ranks) for address in addresses]
    source, destination = PoolClient(addresses[0], PEER), PoolClient(addresses[1], PEER)
    try:
        slots = engines[0].call(PrepareStore(keys)).stored.slots
        memory = PoolMemory.over(engines[0].memory, engines[0].header_bytes, len(keys), ranks)
        for rank, rank_caches in enumerate(caches):
            store_blocks([cache_rows(c) for c in rank_caches], blocks, memory, slots, keys, rank)
        engines[0].call(CompleteStore(keys, success=True))
        engines[1].connected()  # the destination pool's namespace, as its engine would set it
        started = time.perf_counter()
        writer = BlockWriter(destination, keys)
        for chunk in read_blocks(source, writer.wanted):
            writer.write(chunk)
        fetched = writer.finish()
        fetch_s = time.perf_counter() - started
        assert fetched == len(keys), f"{fetched} of {len(keys)} blocks fetched"
        loaded = engines[1].call(PrepareLoad(keys)).slots
        target_memory = PoolMemory.over(
            engines[1].memory, engines[1].header_bytes, len(keys), ranks
        )
        for rank, rank_targets in enumerate(targets):
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, blocks, target_memory, loaded, keys, rank)
            assert not refused, f"rank {rank}: fetched blocks refused: {refused}"
            assert torch.equal(rank_targets[0][blocks], caches[rank][0][blocks]), (
                f"rank {rank}: fetched blocks came back changed"
            )
        engines[1].call(CompleteLoad(keys))
        memory.part(slots[0], 1)[5] ^= 1  # the source's first block, rank 1's part
        engines[1].call(Drop(keys))
        writer = BlockWriter(destination, keys)
        with pytest.raises(Damaged):
            for chunk in read_blocks(source, writer.wanted):
                writer.write(chunk)
        assert not writer.finish(), "a damaged block was written"
        assert not engines[1].call(Lookup(keys)).blocks, "a damaged block became loadable"
    finally:
        for client in (*engines, source, destination):
            client.close()
    rate = len(keys) * slot / fetch_s / 1e9
    record_property(
        "detail", f"bit-exact for 2 ranks' parts, a flipped bit refused on arrival; {rate:.2f} GB/s"
    )
