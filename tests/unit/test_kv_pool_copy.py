"""What pdserve's offloading worker (kv_transfer/pool_offload.py) copies through a real pool
store: a block stored by one engine's worker lands bit for bit in another's cache; a block
whose bytes changed in the pool, or whose slot holds another key, is refused (reported for
recomputation and dropped from the pool), never copied; a load planned against a store that is
gone fails the same way."""

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from kv_transfer.pool_client import PoolClient
from pdserve.cluster.local_services import start_kv_pool
from pdserve.worker.processes import stop_group

if TYPE_CHECKING:  # vLLM is imported where a test runs, not where every test process collects
    from kv_transfer.pool_offload import PoolManager, PoolWorker

BLOCKS = 6
PAGES = (1024, 512)  # two cache tensors: bytes of one block in each
SLOT = sum(PAGES)


@pytest.fixture
def address(tmp_path):
    address, store = start_kv_pool(tmp_path / "kv-pool.log", 4 * SLOT)
    yield address
    stop_group(store.pid, process=store)


def engine(address: str) -> tuple["PoolManager", "PoolWorker", list[torch.Tensor]]:
    """One engine's two halves over a cache of random bytes (float16 and bfloat16 tensors)."""
    from kv_transfer.pool_offload import PoolManager

    manager = PoolManager(PoolClient(address, "ns", SLOT))
    worker, caches = rank_worker(address, "ns", 1, 0)
    return manager, worker, caches


def rank_worker(address: str, namespace: str, ranks: int, rank: int):
    """Rank `rank` of an engine of `ranks`: its worker side over its own cache of random bytes
    (float16 and bfloat16 tensors), with its own connection (a rank is a process)."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    from kv_transfer.pool_offload import PoolWorker

    caches = [
        torch.randn(BLOCKS, PAGES[0] // 2, dtype=torch.float16),
        torch.randn(BLOCKS, PAGES[1] // 2, dtype=torch.bfloat16),
    ]
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t[0].numel() * t.element_size()) for t in caches],
        group_data_refs=[[]],
    )
    client = PoolClient(address, namespace, ranks * SLOT, ranks)
    return PoolWorker(canonical, client, rank), caches


def gpu(blocks: list[int]):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    return GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])


def request(name: str = "request-1"):
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(name)


def store(manager: "PoolManager", worker: "PoolWorker", keys: list[bytes], blocks: list[int]):
    plan = manager.prepare_store(keys, request())
    worker.submit_store(1, gpu(blocks), plan.store_spec)
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == len(blocks) * SLOT
    manager.complete_store(keys, request())


def test_a_stored_block_lands_bit_for_bit_in_another_engines_cache(address):
    manager_a, worker_a, caches_a = engine(address)
    manager_b, worker_b, caches_b = engine(address)
    store(manager_a, worker_a, [b"k0", b"k1"], [2, 5])
    assert manager_b.lookup(b"k1", request()).name == "HIT"
    spec = manager_b.prepare_load([b"k0", b"k1"], request())
    worker_b.submit_load(2, spec, gpu([0, 3]))
    manager_b.complete_load([b"k0", b"k1"], request())
    assert worker_b.take_failed_blocks() == set()
    for a, b in zip(caches_a, caches_b, strict=True):
        assert torch.equal(a[2].view(torch.uint8), b[0].view(torch.uint8))
        assert torch.equal(a[5].view(torch.uint8), b[3].view(torch.uint8))


def test_a_changed_byte_or_another_keys_slot_is_refused_and_dropped(address):
    from kv_transfer.pool_offload import PoolSlots

    manager_a, worker_a, _ = engine(address)
    manager_b, worker_b, caches_b = engine(address)
    store(manager_a, worker_a, [b"k0", b"k1", b"k2"], [0, 1, 2])
    before = [cache.clone() for cache in caches_b]
    client = worker_a.client
    view = np.frombuffer(client.memory, np.uint8)
    spec = manager_b.prepare_load([b"k0", b"k1", b"k2"], request())
    view[client.header_bytes + spec.slots[0] * SLOT + 7] ^= 1  # k0's bytes changed
    swapped = PoolSlots(spec.store_id, [spec.slots[0], spec.slots[1], spec.slots[1]], spec.keys)
    worker_b.submit_load(2, swapped, gpu([3, 4, 5]))  # k0 damaged, k1 fine, k2 reads k1's slot
    assert worker_b.take_failed_blocks() == {3, 5}
    for cache, old in zip(caches_b, before, strict=True):
        assert torch.equal(cache[3].view(torch.uint8), old[3].view(torch.uint8))
        assert torch.equal(cache[5].view(torch.uint8), old[5].view(torch.uint8))
        assert not torch.equal(cache[4].view(torch.uint8), old[4].view(torch.uint8))
    manager_b.complete_load([b"k0", b"k1", b"k2"], request())
    assert manager_b.client.call("stats")["dropped"] == 2
    assert manager_b.lookup(b"k0", request()).name == "MISS"


def test_a_load_planned_against_a_store_that_is_gone_is_refused(address):
    from kv_transfer.pool_offload import PoolSlots

    manager, worker, caches = engine(address)
    store(manager, worker, [b"k0"], [0])
    spec = manager.prepare_load([b"k0"], request())
    stale = PoolSlots("another store", spec.slots, spec.keys)
    before = caches[0][1].clone()
    worker.submit_load(2, stale, gpu([1]))
    assert worker.take_failed_blocks() == {1}
    assert torch.equal(caches[0][1], before)


def test_a_load_that_pinned_nothing_does_not_unpin_another_loads_blocks(address):
    manager_a, worker_a, _ = engine(address)
    manager_b, _, _ = engine(address)
    store(manager_a, worker_a, [b"k0"], [0])
    assert manager_b.prepare_load([b"k0"], request("holder")).slots is not None  # pinned
    missing = manager_b.prepare_load([b"k0", b"gone"], request("late"))
    assert missing.slots is None
    manager_b.complete_load([b"k0", b"gone"], request("late"))
    # k0 is still pinned by "holder": a store needing every slot cannot evict it
    assert manager_a.prepare_store([b"x1", b"x2", b"x3", b"x4"], request()) is None
    manager_b.complete_load([b"k0"], request("holder"))
    assert manager_a.prepare_store([b"x1", b"x2", b"x3", b"x4"], request()) is not None


def test_each_tensor_parallel_rank_stores_and_checks_its_own_part_of_a_block(tmp_path):
    """An engine of two ranks: each rank's blocks land bit for bit in the same rank of another
    engine; a byte changed in rank 1's part is refused by rank 1 alone (vLLM then recomputes the
    block on every rank) and the block is dropped; an engine of another TP is refused."""
    from kv_transfer.pool_offload import PoolManager

    address, process = start_kv_pool(tmp_path / "kv-pool.log", 4 * 2 * SLOT)
    try:
        manager_a = PoolManager(PoolClient(address, "tp2", 2 * SLOT, 2))
        ranks_a = [rank_worker(address, "tp2", 2, rank) for rank in (0, 1)]
        manager_b = PoolManager(PoolClient(address, "tp2", 2 * SLOT, 2))
        ranks_b = [rank_worker(address, "tp2", 2, rank) for rank in (0, 1)]
        keys = [b"k0", b"k1"]
        plan = manager_a.prepare_store(keys, request())
        for worker, _ in ranks_a:
            worker.submit_store(1, gpu([2, 5]), plan.store_spec)
            (result,) = worker.get_finished()
            assert result.transfer_size == 2 * SLOT  # its own part of each block
        manager_a.complete_store(keys, request())

        spec = manager_b.prepare_load(keys, request())
        for (worker_b, caches_b), (_, caches_a) in zip(ranks_b, ranks_a, strict=True):
            worker_b.submit_load(2, spec, gpu([0, 3]))
            assert worker_b.take_failed_blocks() == set()
            for a, b in zip(caches_a, caches_b, strict=True):
                assert torch.equal(a[2].view(torch.uint8), b[0].view(torch.uint8))
                assert torch.equal(a[5].view(torch.uint8), b[3].view(torch.uint8))
        manager_b.complete_load(keys, request())

        client = ranks_a[0][0].client
        view = np.frombuffer(client.memory, np.uint8)
        spec = manager_b.prepare_load(keys, request())
        view[client.header_bytes + spec.slots[0] * 2 * SLOT + SLOT + 7] ^= 1  # rank 1's k0
        failed = []
        for worker_b, _ in ranks_b:
            worker_b.submit_load(3, spec, gpu([1, 4]))
            failed.append(worker_b.take_failed_blocks())
        assert failed == [set(), {1}]
        manager_b.complete_load(keys, request())
        assert manager_b.client.call("stats")["dropped"] == 1
        assert manager_b.lookup(b"k0", request()).name == "MISS"
        assert manager_b.lookup(b"k1", request()).name == "HIT"

        assert PoolClient(address, "tp2", SLOT, 1).call("lookup", [b"k1"]) is None
    finally:
        stop_group(process.pid, process=process)


def test_a_store_is_copied_a_budget_a_step_and_wait_copies_all_that_is_pending(
    address, monkeypatch
):
    """A store larger than a step's budget finishes over several engine steps (its job is
    reported once, whole); vLLM's `wait` before reusing blocks copies every pending store at
    once; what was stored loads bit for bit."""
    monkeypatch.setattr("kv_transfer.pool_offload.STORE_BYTES_PER_STEP", SLOT)  # one block a step
    manager_a, worker_a, caches_a = engine(address)
    manager_b, worker_b, caches_b = engine(address)
    plan = manager_a.prepare_store([b"k0", b"k1", b"k2"], request())
    worker_a.submit_store(1, gpu([0, 1, 2]), plan.store_spec)
    assert worker_a.get_finished() == [] and worker_a.get_finished() == []
    (result,) = worker_a.get_finished()
    assert (result.job_id, result.transfer_size) == (1, 3 * SLOT)
    manager_a.complete_store([b"k0", b"k1", b"k2"], request())
    plan = manager_a.prepare_store([b"k3"], request())
    worker_a.submit_store(2, gpu([3]), plan.store_spec)
    worker_a.wait({2})
    assert worker_a.stores == deque()
    manager_a.complete_store([b"k3"], request())
    assert [r.job_id for r in worker_a.get_finished()] == [2]
    keys = [b"k0", b"k1", b"k2", b"k3"]
    worker_b.submit_load(3, manager_b.prepare_load(keys, request()), gpu([5, 4, 3, 2]))
    assert worker_b.take_failed_blocks() == set()
    for a, b in zip(caches_a, caches_b, strict=True):
        for source, target in zip([0, 1, 2, 3], [5, 4, 3, 2], strict=True):
            assert torch.equal(a[source].view(torch.uint8), b[target].view(torch.uint8))
