"""What pdserve's offloading worker (kv_transfer/pool/offload.py) copies through a real pool
store: a block stored by one engine's worker lands bit for bit in another's cache; a block
whose bytes changed in the pool, or whose slot holds another key, is refused (reported for
recomputation and dropped from the pool), never copied; a load planned against a store that is
gone fails the same way."""

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import GetStats, Lookup
from pdserve.cluster.local_services import start_kv_pool
from pdserve.worker.processes import stop_group

if TYPE_CHECKING:  # vLLM is imported where a test runs, not where every test process collects
    from kv_transfer.pool.offload import PoolManager, PoolWorker

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
    from kv_transfer.pool.offload import PoolManager

    manager = PoolManager(PoolClient(address, "ns", SLOT))
    worker, caches = rank_worker(address, "ns", 1, 0)
    return manager, worker, caches


def random_caches():
    """A rank's cache of random bytes (float16 and bfloat16 tensors), and as vLLM's offloading
    connector hands it to the worker."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    caches = [
        torch.randn(BLOCKS, PAGES[0] // 2, dtype=torch.float16),
        torch.randn(BLOCKS, PAGES[1] // 2, dtype=torch.bfloat16),
    ]
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, t[0].numel() * t.element_size()) for t in caches],
        group_data_refs=[[]],
    )
    return caches, canonical


def rank_worker(address: str, namespace: str, ranks: int, rank: int):
    """Rank `rank` of an engine of `ranks`: its worker side over its own cache of random bytes,
    with its own connection (a rank is a process)."""
    from kv_transfer.pool.offload import PoolWorker

    caches, canonical = random_caches()
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
    from kv_transfer.pool.offload import PoolSlots

    manager_a, worker_a, _ = engine(address)
    manager_b, worker_b, caches_b = engine(address)
    store(manager_a, worker_a, [b"k0", b"k1", b"k2"], [0, 1, 2])
    before = [cache.clone() for cache in caches_b]
    client = worker_a.client
    view = np.frombuffer(client.memory, np.uint8)
    spec = manager_b.prepare_load([b"k0", b"k1", b"k2"], request())
    view[client.header_bytes + spec.slots[0] * SLOT + 7] ^= 1  # k0's bytes changed
    swapped = PoolSlots(spec.store_id, (spec.slots[0], spec.slots[1], spec.slots[1]), spec.keys)
    worker_b.submit_load(2, swapped, gpu([3, 4, 5]))  # k0 damaged, k1 fine, k2 reads k1's slot
    assert worker_b.take_failed_blocks() == {3, 5}
    for cache, old in zip(caches_b, before, strict=True):
        assert torch.equal(cache[3].view(torch.uint8), old[3].view(torch.uint8))
        assert torch.equal(cache[5].view(torch.uint8), old[5].view(torch.uint8))
        assert not torch.equal(cache[4].view(torch.uint8), old[4].view(torch.uint8))
    manager_b.complete_load([b"k0", b"k1", b"k2"], request())
    assert manager_b.client.call(GetStats()).dropped == 2
    assert manager_b.lookup(b"k0", request()).name == "MISS"


def test_a_load_planned_against_a_store_that_is_gone_is_refused(address):
    from kv_transfer.pool.offload import PoolSlots

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
    from kv_transfer.pool.offload import PoolManager

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
        assert manager_b.client.call(GetStats()).dropped == 1
        assert manager_b.lookup(b"k0", request()).name == "MISS"
        assert manager_b.lookup(b"k1", request()).name == "HIT"

        assert PoolClient(address, "tp2", SLOT, 1).call(Lookup((b"k1",))) is None
    finally:
        stop_group(process.pid, process=process)


def mla_spec(address: str, tp: int, rank: int):
    """Rank `rank`'s PoolOffloadingSpec in an MLA engine of `tp` ranks, from the config vLLM's
    OffloadingConnector makes (which says the layout is replicated at TP > 1)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kv_transfer.pool.config import POOL_ADDRESS, POOL_NAMESPACE
    from kv_transfer.pool.offload import PoolOffloadingSpec

    return PoolOffloadingSpec(
        OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layers.0", "layers.1"), 0),),
            worker_kv_bytes_per_block=SLOT,
            enable_kv_cache_events=False,
            extra_config={POOL_ADDRESS: address, POOL_NAMESPACE: "mla"},
            engine_id=f"tp{tp}",
            model=OffloadingModelConfig("deepseek", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank, tp, tp, 1, 1, 1, 0, 1, None, False),
            replicated_layout=tp > 1,
            kv_cache_layout="LBHNC",
        )
    )


def test_an_mla_engines_latent_is_stored_once_by_rank_0_and_loaded_by_every_rank(
    address, monkeypatch
):
    """Every rank of an MLA engine holds the same latent: a slot keeps one copy (one part of one
    rank's block bytes), only rank 0 writes it (vLLM's offloading worker asks no other rank),
    every rank loads it, and an engine at another TP shares it (the same namespace)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    specs = [mla_spec(address, 2, rank) for rank in (0, 1)]
    assert specs[0].client_args[2:] == (SLOT, 1)  # one copy a block, in one part
    writers = [OffloadingConnectorWorker(spec, None, None)._is_store_writer for spec in specs]
    assert writers == [True, False]
    ranks = []
    for rank, spec in enumerate(specs):  # each rank's worker, over its own cache
        monkeypatch.setattr(
            "kv_transfer.pool.offload.get_tensor_model_parallel_rank", lambda rank=rank: rank
        )
        caches, canonical = random_caches()
        ranks.append((spec.get_worker(canonical), caches))
    (writer, written), _ = ranks
    manager = specs[0].get_manager()
    keys = [b"k0", b"k1"]
    plan = manager.prepare_store(keys, request())
    writer.submit_store(1, gpu([2, 5]), plan.store_spec)
    (result,) = writer.get_finished()
    assert result.transfer_size == 2 * SLOT
    manager.complete_store(keys, request())
    assert manager.client.call(GetStats()).slot_bytes == SLOT

    tp1 = mla_spec(address, 1, 0)
    assert tp1.client_args[1] == specs[0].client_args[1]  # the namespace: TP does not enter it
    caches, canonical = random_caches()
    loaders = [*ranks, (tp1.get_worker(canonical), caches)]
    reader = tp1.get_manager()
    spec = reader.prepare_load(keys, request())
    for worker, caches in loaders:
        worker.submit_load(2, spec, gpu([0, 3]))
        assert worker.take_failed_blocks() == set()
        for a, b in zip(written, caches, strict=True):
            assert torch.equal(a[2].view(torch.uint8), b[0].view(torch.uint8))
            assert torch.equal(a[5].view(torch.uint8), b[3].view(torch.uint8))
    reader.complete_load(keys, request())


def test_a_store_is_copied_a_budget_a_step_and_wait_copies_all_that_is_pending(
    address, monkeypatch
):
    """A store larger than a step's budget finishes over several engine steps (its job is
    reported once, whole); vLLM's `wait` before reusing blocks copies every pending store at
    once; what was stored loads bit for bit."""
    monkeypatch.setattr("kv_transfer.pool.offload.CPU_STORE_BYTES_PER_STEP", SLOT)  # a block a step
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


def vllm_worker(address: str, layers: int, blocks: int, page: int, side_stream=None):
    """A worker over a cache allocated as vLLM 0.32 allocates it (one buffer, a (blocks, page)
    view per layer), with a pool of `blocks` slots of its size."""
    from vllm.v1.kv_offload.base import CanonicalKVCaches, CanonicalKVCacheTensor

    from kv_transfer.pool.offload import PoolManager, PoolWorker

    buffer = torch.randint(-128, 128, (layers * blocks * page,), dtype=torch.int8)
    caches = [layer.view(blocks, page) for layer in buffer.view(layers, -1)]
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(cache, page) for cache in caches], group_data_refs=[[]]
    )
    client = PoolClient(address, f"vllm-{layers}x{page}", layers * page)
    manager = PoolManager(PoolClient(address, f"vllm-{layers}x{page}", layers * page))
    return manager, PoolWorker(canonical, client, 0, side_stream), caches


def test_the_worker_never_synchronises_a_job_of_8_blocks_x_32_layers(tmp_path, monkeypatch):
    """vLLM's calls into the worker for a store and a load of 8 blocks x 32 layers make no
    synchronising call (.item(), int() of a tensor, a stream or event synchronize) and copy in
    a few launches, not one per block or layer (tests/unit/test_kv_pool_sync.py counts the
    copier alone, before and after)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layers, page = 32, 2048
    address, process = start_kv_pool(tmp_path / "kv-pool.log", 16 * layers * page)
    syncs = []
    monkeypatch.setattr(torch.Tensor, "item", lambda *a: syncs.append("item"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda *a: syncs.append("event"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda *a: syncs.append("stream"))

    class Counted(TorchDispatchMode):
        ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    try:
        manager, worker, caches = vllm_worker(address, layers, 16, page)
        keys = [f"k{i}".encode() for i in range(8)]
        plan = manager.prepare_store(keys, request())
        with Counted() as counted:
            worker.submit_store(1, gpu(list(range(8))), plan.store_spec)
            (stored,) = worker.get_finished()
        store_ops = list(counted.ops)
        manager.complete_store(keys, request())
        spec = manager.prepare_load(keys, request())
        counted.ops.clear()
        with Counted() as counted:
            worker.submit_load(2, spec, gpu(list(range(8, 16))))
            (loaded,) = worker.get_finished()
        load_ops = list(counted.ops)
        manager.complete_load(keys, request())
    finally:
        stop_group(process.pid, process=process)
    assert stored.transfer_size == loaded.transfer_size == 8 * layers * page
    assert worker.take_failed_blocks() == set()
    for cache in caches:
        assert torch.equal(cache[:8], cache[8:])
    for ops in (store_ops, load_ops):
        assert syncs == [] and "_local_scalar_dense" not in ops, (syncs, ops)
        copies = [op for op in ops if op in {"copy_", "index_select", "index_copy_", "where"}]
        assert len(copies) <= 4, copies


class HeldEvent:
    def __init__(self, stream):
        self.stream = stream

    def query(self) -> bool:
        return self.stream.released

    def synchronize(self) -> None:
        raise AssertionError("vLLM's thread waited for the device")


class HeldStream:
    """A side stream whose work runs at once but whose events pass only when `released` (as
    host_staging.CudaSideStream is driven)."""

    released = False
    fences = 0

    def follow_forward(self) -> None:
        pass

    def submit(self, work) -> None:
        work()

    def record(self) -> HeldEvent:
        return HeldEvent(self)

    def synchronize(self) -> None:
        raise AssertionError("vLLM's thread waited for the device")

    def precede_forward(self) -> None:
        self.fences += 1


def test_on_a_stream_jobs_finish_by_event_query_and_a_refused_block_is_reported_with_its_load(
    tmp_path,
):
    """With copies queued on a stream, a store is finished (and its blocks loadable) only once
    its event passed, `wait` fences the forward stream instead of waiting, and a load's
    refused block is reported in the same step as the load, once it is done (vLLM reads
    get_finished, then the load errors)."""
    layers, page = 4, 2048
    address, process = start_kv_pool(tmp_path / "kv-pool.log", 16 * layers * page)
    stream = HeldStream()
    try:
        manager, worker, caches = vllm_worker(address, layers, 16, page, stream)
        keys = [f"k{i}".encode() for i in range(4)]
        plan = manager.prepare_store(keys, request())
        worker.submit_store(1, gpu([0, 1, 2, 3]), plan.store_spec)
        assert worker.get_finished() == []
        worker.wait({1})
        assert stream.fences == 1 and worker.get_finished() == []
        stream.released = True
        (stored,) = worker.get_finished()
        assert (stored.job_id, stored.transfer_size) == (1, 4 * layers * page)
        manager.complete_store(keys, request())

        stream.released = False
        spec = manager.prepare_load(keys, request())
        client = worker.client
        memory = client.memory
        memory[client.header_bytes + spec.slots[1] * layers * page + 3] ^= 1  # k1's bytes
        before = [cache[9].clone() for cache in caches]
        worker.submit_load(2, spec, gpu([8, 9, 10, 11]))
        assert worker.get_finished() == [] and worker.take_failed_blocks() == set()
        stream.released = True
        (loaded,) = worker.get_finished()
        assert (loaded.job_id, loaded.transfer_size) == (2, 3 * layers * page)
        assert worker.take_failed_blocks() == {9}
        manager.complete_load(keys, request())
        for cache, old in zip(caches, before, strict=True):
            assert torch.equal(cache[9], old)
            assert torch.equal(cache[8], cache[0]) and torch.equal(cache[11], cache[3])
        assert manager.client.call(GetStats()).dropped == 1
    finally:
        stop_group(process.pid, process=process)


def test_a_large_load_or_flushed_store_is_copied_in_bounded_pieces_and_reported_once(
    tmp_path, monkeypatch
):
    """A load larger than COPY_BYTES is several queued copies, reported as one load once all
    are done, with a refused block among them; `wait` queues pending stores in pieces too."""
    monkeypatch.setattr("kv_transfer.pool.offload.COPY_BYTES", 3 * 4 * 2048)  # 3 blocks
    layers, page = 4, 2048
    address, process = start_kv_pool(tmp_path / "kv-pool.log", 16 * layers * page)
    stream = HeldStream()
    try:
        manager, worker, caches = vllm_worker(address, layers, 16, page, stream)
        keys = [f"k{i}".encode() for i in range(7)]
        plan = manager.prepare_store(keys, request())
        worker.submit_store(1, gpu(list(range(7))), plan.store_spec)
        worker.wait({1})
        assert [flight.count for flight in worker.in_flight] == [3, 3, 1]
        stream.released = True
        assert [r.job_id for r in worker.get_finished()] == [1]
        manager.complete_store(keys, request())

        stream.released = False
        spec = manager.prepare_load(keys, request())
        client = worker.client
        client.memory[client.header_bytes + spec.slots[4] * layers * page] ^= 1  # k4's bytes
        worker.submit_load(2, spec, gpu(list(range(8, 15))))
        assert [flight.count for flight in worker.in_flight] == [3, 3, 1]
        assert worker.get_finished() == []
        stream.released = True
        (loaded,) = worker.get_finished()
        assert (loaded.job_id, loaded.transfer_size) == (2, 6 * layers * page)
        assert worker.take_failed_blocks() == {12}
        manager.complete_load(keys, request())
        for cache in caches:
            for block in (0, 1, 2, 3, 5, 6):
                assert torch.equal(cache[block], cache[block + 8])
    finally:
        stop_group(process.pid, process=process)
