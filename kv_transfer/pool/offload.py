"""The host KV pool as a vLLM offloading tier: vLLM's OffloadingConnector decides which blocks
to store after they are computed and which to load when a prompt's prefix misses the engine's
own cache (by vLLM's chained block hash); this module answers it from the host's pool
(kv_transfer/pool/store.py) instead of a private CPU buffer, so every worker of the host shares
what any of them computed.

- `PoolManager` (the engine's scheduler side) asks the store: lookup, pin for a load, make room
  for a store. The store being gone answers "miss" and "no room": the engine computes.
- `PoolWorker` (each worker rank) copies between the engine's KV cache and the pool's memory
  through a PoolCopier (kv_transfer/pool/copy.py), called on the engine's thread but never
  waiting for the device there: on a GPU a job is queued on a side stream after the step's
  forward (one gather or scatter over its blocks x layers, one copy per run of slots into the
  pool's memory, registered with CUDA as pinned at the engine's start, its digests taken on the
  device) and finished in a later `get_finished`, once an event after it has passed (a query).
  On a CPU the same job is copied in the call. A load is queued at once, in copies of at most
  COPY_BYTES (CPU_COPY_BYTES on a CPU), and reported (with any block it refused) once done, so
  its request waits for it; a store is queued STORE_BYTES_PER_STEP (CPU_STORE_BYTES_PER_STEP on
  a CPU) at a time, one engine step after another, so the decode step after a long prefill does
  not pay for the whole prompt's copy at once (on a CPU, where the copy runs in the step). vLLM
  keeps stepping while a store is pending (idle engines included), and before it reuses a block
  a pending store reads it asks `wait`, which queues everything pending and makes the forward
  stream wait for it on the device (not the thread).
  A tensor-parallel rank copies its own heads, into and out of its part of each slot; vLLM
  completes a store only once every rank has done its part, and recomputes a block any rank
  could not load. An MLA latent, the same on every rank, is one part: rank 0 stores it, every
  rank loads it (vLLM's replicated layout). A writer puts its key's tag and its bytes' digest
  (kv_transfer/integrity.py) in its part's header once its bytes landed; a reader checks both,
  on the device, before one byte reaches the cache, and a block that fails is dropped from the
  pool, counted, and recomputed (kv_transfer/pool/connector.py reports it to vLLM as a load
  error), never used.

vLLM 0.32's own CPU offloading worker needs CUDA streams (it refuses the CPU platform) and keeps
a private buffer per engine, which is why pdserve has its own worker and manager here; the
scheduler side that chooses what to store and load is vLLM's.
"""

import json
import logging
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.config import POOL_ADDRESS, POOL_NAMESPACE
from kv_transfer.pool.copy import Copy, PoolCopier, PoolMemory, cache_rows
from kv_transfer.pool.wire import (
    CompleteLoad,
    CompleteStore,
    Drop,
    GetStats,
    Lookup,
    PoolRequest,
    PrepareLoad,
    PrepareStore,
    Reply,
)

log = logging.getLogger("pdserve.kv")
# Store copies queued per engine step, at least one block. On a GPU they run beside the forward
# on a side stream (a 70B model's 16-token block per rank: 0.6 MiB, ~13 us over pinned PCIe). On
# a CPU they run in the step, before its forward: SmolLM2's 5.6 MiB block takes ~3.7 ms with its
# digest on this host's contended cores, and 16 MiB made the step after a long prompt's prefill
# (its second token) ~11 ms longer than the others (a 1,536-token prompt's hand-off 1.22 ITL, 1.0
# without stores); one block a step still stores ~15 blocks/s here, ~2x what its prefill computes.
STORE_BYTES_PER_STEP = 16 << 20
CPU_STORE_BYTES_PER_STEP = 4 << 20
# One queued copy's bytes at most (at least a block): on a GPU, what it holds of device memory
# beside vLLM's cache while it runs is about twice that (the bytes, and a load's kept rows); on
# a CPU, a copy small enough to stay in the L3 cache from its copy to its digest and scatter
# (SmolLM2 on this host: stores 6.6 GB/s a block at a time, 4.9 by 8 blocks; loads 4.0 and 3.0).
COPY_BYTES = 32 << 20
CPU_COPY_BYTES = 8 << 20


@dataclass
class PoolSlots(LoadStoreSpec):
    """Where a load reads or a store writes, block by block in the scheduler's order: the
    store it was planned against (another store's slots mean nothing), each block's slot and
    key. `slots` is None for a load the store could not pin any more."""

    store_id: str | None
    slots: tuple[int, ...] | None
    keys: tuple[bytes, ...]


class PoolManager(OffloadingManager):
    """The scheduler's side. `client` None: this engine does not use the pool (every lookup
    misses, nothing is stored)."""

    def __init__(self, client: PoolClient | None):
        self.client = client
        self._unpinned: set[str] = set()  # requests whose last load found its blocks gone

    def _call(self, request: PoolRequest[Reply]) -> Reply | None:
        return self.client.call(request) if self.client is not None else None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._call(Lookup((key,)))
        return LookupResult.HIT if found and found.blocks else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PoolSlots:
        keys = tuple(keys)
        pinned = self._call(PrepareLoad(keys))
        slots = pinned.slots if pinned else None
        if slots is None:  # nothing pinned: its complete_load must not unpin another load's
            self._unpinned.add(req_context.req_id)
        store_id = self.client.store_id if self.client is not None else None
        return PoolSlots(store_id, slots, keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if req_context.req_id in self._unpinned:
            self._unpinned.discard(req_context.req_id)
            return
        self._call(CompleteLoad(tuple(keys)))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        reserved = self._call(PrepareStore(tuple(keys)))
        stored = reserved.stored if reserved else None
        if stored is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(key) for key in stored.keys],
            store_spec=PoolSlots(self.client.store_id, stored.slots, stored.keys),
            evicted_keys=[OffloadKey(key) for key in stored.evicted],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._call(CompleteStore(tuple(keys), success))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()


@dataclass
class PendingStore:
    """A store job, queued for copying a budget of blocks per engine step."""

    job_id: int
    blocks: list[int]
    memory: PoolMemory
    slots: tuple[int, ...]
    keys: tuple[bytes, ...]
    started: float  # when vLLM submitted it
    queued: int = 0  # blocks whose copy is queued
    landed: int = 0  # blocks whose copy is done (their headers written)
    size: int = 0  # their bytes


@dataclass
class PendingLoad:
    """A load job, queued in copies of at most COPY_BYTES, reported once all are done."""

    job_id: int
    started: float
    copies: int = 0  # queued
    landed: int = 0  # done
    size: int = 0  # bytes loaded
    refused: list[int] = field(default_factory=list)  # blocks that failed their check
    refused_keys: list[bytes] = field(default_factory=list)


@dataclass
class InFlight:
    """A queued copy (PoolCopier's), in the order of the copier's stream: `count` blocks of a
    store or of a load."""

    copy: Copy
    memory: PoolMemory
    store: PendingStore | None = None
    load: PendingLoad | None = None
    count: int = 0


class PoolWorker(OffloadingWorker):
    """The worker's side, in rank `part` of the engine. `client` None: this engine does not use
    the pool (no job comes). `side_stream`: where the copier queues its jobs (a fake in tests;
    by default a CUDA side stream for a CUDA cache, none on CPU)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        client: PoolClient | None,
        part: int,
        side_stream=None,
    ):
        # vLLM hands each cache tensor over as (blocks, bytes of one block): int8 rows, possibly
        # strided; a block's slot holds its rows, in this order (kv_transfer/pool/copy.py).
        self.pages = [cache_rows(t.tensor) for t in kv_caches.tensors]
        self.block_bytes = sum(page.shape[1] for page in self.pages)
        if client is not None and self.block_bytes * client.parts != client.slot_bytes:
            log.error(
                "kv pool: off: a KV block here is %d B in each of %d ranks, the pool's slots %d B",
                self.block_bytes,
                client.parts,
                client.slot_bytes,
            )
            client = None
        self.client = client
        self.part = part
        self.copier = PoolCopier(self.pages, part, side_stream)
        on_gpu = self.copier.side is not None
        most = COPY_BYTES if on_gpu else CPU_COPY_BYTES
        self._blocks_per_copy = max(1, most // self.block_bytes)
        self._store_budget = STORE_BYTES_PER_STEP if on_gpu else CPU_STORE_BYTES_PER_STEP
        self.stores: deque[PendingStore] = deque()  # not all queued yet, in vLLM's order
        self.in_flight: deque[InFlight] = deque()  # queued copies, in the stream's order
        self.finished: list[TransferResult] = []
        self.failed_blocks: set[int] = set()  # cache blocks whose load failed its check
        self._mapped: PoolMemory | None = None  # the store's memory as mapped now
        self._mapped_from = None  # the client's mapping it views
        self._retired: list[PoolMemory] = []  # earlier mappings, registered until unused
        self._registering = None  # a registration whose outcome is not logged yet
        if client is not None and self.copier.pin and client.connected():
            # At the engine's start (before vLLM captures CUDA graphs): pinning the whole pool
            # takes a while, better here than on the first step that copies.
            self._mapping(wait=True)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: PoolSlots) -> bool:
        memory = self._memory(dst_spec)
        if memory is None:  # a future miss: the header check refuses the slot's bytes
            self.finished.append(TransferResult(job_id, True, 0, 0.0))
            return True
        blocks = [int(block) for block in src_spec.block_ids]
        self.stores.append(
            PendingStore(job_id, blocks, memory, dst_spec.slots, dst_spec.keys, time.perf_counter())
        )
        return True

    def _queue_stores(self, budget: int | None) -> None:
        """Queue copies of pending stores' blocks, oldest first, up to `budget` bytes (at
        least a block; None: all of them). Queued, not done: `_collect` finishes them."""
        queued = 0
        while self.stores and (budget is None or queued < budget):
            job = self.stores[0]
            take = min(len(job.blocks) - job.queued, self._blocks_per_copy)
            if budget is not None:
                take = min(take, max(1, -(-(budget - queued) // self.block_bytes)))
            batch = slice(job.queued, job.queued + take)
            copy = self.copier.store(
                job.blocks[batch], job.memory, job.slots[batch], job.keys[batch]
            )
            self.in_flight.append(InFlight(copy, job.memory, store=job, count=take))
            job.queued += take
            queued += take * self.block_bytes
            if job.queued == len(job.blocks):
                self.stores.popleft()

    def _collect(self) -> None:
        """Finish the copies that are done (an event query each, in the stream's order): a
        store's headers are written, a whole store is finished; a load's refused blocks are
        reported (dropped from the pool, recomputed) with the load."""
        while self.in_flight and self.in_flight[0].copy.passed():
            done = self.in_flight.popleft()
            result = done.copy.result()
            now = time.perf_counter()
            if done.store is not None:
                job = done.store
                job.landed, job.size = job.landed + done.count, job.size + result
                if job.landed == len(job.blocks):
                    self.finished.append(
                        TransferResult(job.job_id, True, job.size, now - job.started)
                    )
                continue
            job, (size, refused, keys) = done.load, result
            job.landed, job.size = job.landed + 1, job.size + size
            job.refused.extend(refused)
            job.refused_keys.extend(keys)
            if job.landed < job.copies:
                continue
            if job.refused:  # reported with the load, in the same step
                self.failed_blocks.update(job.refused)
                self.client.call(Drop(tuple(job.refused_keys)))  # client set: memory came from it
                log.warning(
                    "kv pool: %d block(s) failed their check: dropped, recomputed",
                    len(job.refused),
                )
            self.finished.append(TransferResult(job.job_id, True, job.size, now - job.started))

    def submit_load(self, job_id: int, src_spec: PoolSlots, dst_spec: GPULoadStoreSpec) -> bool:
        started = time.perf_counter()
        blocks = [int(block) for block in dst_spec.block_ids]
        planned = src_spec.slots is not None and len(src_spec.slots) == len(blocks)
        memory = self._memory(src_spec) if planned else None
        if memory is None:
            self.failed_blocks.update(blocks)
            self.finished.append(TransferResult(job_id, True, 0, time.perf_counter() - started))
            return True
        job = PendingLoad(job_id, started)
        for first in range(0, len(blocks), self._blocks_per_copy):
            batch = slice(first, first + self._blocks_per_copy)
            copy = self.copier.load(
                blocks[batch], memory, src_spec.slots[batch], src_spec.keys[batch]
            )
            job.copies += 1
            self.in_flight.append(InFlight(copy, memory, load=job, count=len(blocks[batch])))
        self._collect()  # on a CPU it is done already
        return True

    def _memory(self, spec: PoolSlots) -> PoolMemory | None:
        """The pool's memory, if `spec` was planned against the store this worker is connected
        to now (it connects on first use). A plan for another store means this worker's store
        may be gone: asking it finds out, and a later job connects to the new one."""
        if self.client is None or not self.client.connected():
            return None
        if spec.store_id != self.client.store_id:
            self.client.call(GetStats())
            return None
        return self._mapping()

    def _mapping(self, wait: bool = False) -> PoolMemory:
        """The client's mapping of the store's memory, registered with CUDA beside a CUDA cache
        (`wait`: now; else on a thread of its own, copies staged through pinned memory until
        it is done). A new mapping (a store reconnected to) retires the previous one."""
        client = self.client
        if self._mapped is not None and self._mapped_from is client.memory:
            return self._mapped
        if self._mapped is not None:
            self._retired.append(self._mapped)
        memory = PoolMemory.over(client.memory, client.header_bytes, client.slots, client.parts)
        if self.copier.pin:
            self._registering = memory.register(self.copier.device, wait)
            self._note_registration()
        self._mapped, self._mapped_from = memory, client.memory
        return memory

    def _note_registration(self) -> None:
        """Log how registering the pool's memory went, once it is done."""
        registration = self._registering
        if registration is None or not registration.done.is_set():
            return
        self._registering = None
        size = sum(size for _, size in registration.pieces) / 2**30
        if registration.ok:
            log.info("kv pool: %.1f GiB pinned for CUDA in %.2f s", size, registration.seconds)
        else:
            log.warning(
                "kv pool: its %.1f GiB could not be pinned for CUDA (%s): copies go through "
                "pinned staging memory, with a host copy more each",
                size,
                registration.error,
            )

    def _release_retired(self) -> None:
        """Unregister earlier mappings no queued copy uses any more (on a thread of their own)."""
        if not self._retired:
            return
        busy = {id(f.memory) for f in self.in_flight} | {id(s.memory) for s in self.stores}
        kept = []
        for memory in self._retired:
            registration = memory.registration
            if id(memory) in busy or (registration and not registration.done.is_set()):
                kept.append(memory)
            elif registration is not None:
                registration.release(wait=False)
        self._retired = kept

    def shutdown(self) -> None:
        if self.in_flight and self.copier.side is not None:
            self.copier.side.synchronize()  # the engine is stopping: no step to hold up
        for memory in [*self._retired, self._mapped]:
            if memory is not None and memory.registration is not None:
                memory.registration.release(wait=True)
        if self.client is not None:
            self.client.close()

    def get_finished(self) -> list[TransferResult]:
        self._queue_stores(self._store_budget)
        self._collect()
        self._release_retired()
        self._note_registration()
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """vLLM is about to reuse blocks these jobs read: every pending store is queued now,
        and the forward stream waits for the copies on the device (a fence, not a wait here);
        each is reported by `get_finished` once done, as any other."""
        self._queue_stores(None)
        self.copier.fence()
        self._collect()

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed


class PoolOffloadingSpec(OffloadingSpec):
    """vLLM's name for it: kv_connector_extra_config {"spec_name": "PoolOffloadingSpec",
    "spec_module_path": "kv_transfer.pool.offload", "pool_address": ...}."""

    def __init__(self, config):
        super().__init__(config)
        self.unusable = _why_unusable(config, self.blocks_per_chunk)
        if self.unusable:
            log.warning("kv pool: off for this engine: %s", self.unusable)
        # An MLA engine's ranks hold the same latent (vLLM's replicated layout, at TP > 1):
        # a slot keeps one copy, rank 0 writes it (vLLM's worker asks no other rank to store)
        # and every rank loads it. Its blocks are the same at any TP: the namespace names the
        # parts, not the TP.
        self.replicated_layout = config.replicated_layout
        parts = 1 if self.replicated_layout else config.parallel.tp_size
        namespace = {
            "pool": self.extra_config.get(POOL_NAMESPACE, ""),
            "model": config.model.name,
            "dtype": config.model.dtype,
            "tokens_per_block": self.tokens_per_block,
            "bytes_per_block": config.worker_kv_bytes_per_block,  # of one rank
            "parts": parts,
            "layout": config.kv_cache_layout,
        }
        self.client_args = (
            self.extra_config[POOL_ADDRESS],
            json.dumps(namespace, sort_keys=True),
            config.worker_kv_bytes_per_block * parts,
            parts,
        )
        self._manager: PoolManager | None = None
        self._worker: PoolWorker | None = None

    def _client(self) -> PoolClient | None:
        return None if self.unusable else PoolClient(*self.client_args)

    def get_manager(self) -> PoolManager:
        if self._manager is None:
            client = self._client()
            if client is not None:
                # Join now, not at the first full block: the engine's hello says what the pool
                # holds, which the worker's peer connection (kv_transfer/pool/peer.py) adopts.
                client.connected()
            self._manager = PoolManager(client)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> PoolWorker:
        if self._worker is None:
            part = 0
            if self.config.parallel.tp_size > 1 and not self.replicated_layout:
                part = get_tensor_model_parallel_rank()
            self._worker = PoolWorker(kv_caches, self._client(), part)
        return self._worker


def _why_unusable(config, blocks_per_chunk: int) -> str:
    """Why an engine cannot share blocks through the pool yet, or "": the engine then starts
    and runs as without one (a model the pool does not fit must not stop a worker)."""
    parallel = config.parallel
    if parallel.world_size != parallel.tp_size or parallel.pcp_size != 1 or parallel.dcp_size != 1:
        return "pipeline or context parallelism (tensor parallelism only, yet)"
    if len(config.groups) != 1:
        return f"{len(config.groups)} KV cache groups (one only, yet)"
    if blocks_per_chunk != 1:
        return f"{blocks_per_chunk} engine blocks per offloaded chunk (one only)"
    return ""
