"""KV blocks between an engine's cache and the host pool's memory (kv_transfer/pool/store.py),
with the writer's record and the reader's check: plain torch (no vLLM, no numpy), so the same
code runs in the engine (kv_transfer/pool/offload.py) and in scripts/gpu_check.py on a device.

A slot holds one block: its rows of every cache tensor, back to back; for a tensor-parallel
engine, one part per rank (rank r's rows, at r part-lengths in), which that rank alone writes and
reads. Each part's header entry holds the block key's tag and the digest of the part's bytes
(kv_transfer/integrity.py), written after the bytes. A reader checks both on its own copy of
its part before one byte reaches its cache:
a slot that holds another key (evicted and reused, a store from another epoch) or other bytes
(damaged memory, a writer that died mid-copy or is writing it now) is refused.

A job (`PoolCopier.store` or `.load`, any number of blocks) never waits for the device on the
thread that asks for it, which in an engine is vLLM's:
- a block's rows of every cache tensor are one index over blocks x layers into the cache's
  memory (`CacheRows`; vLLM 0.32 keeps every layer in one allocation): one index_select
  gathers a job's blocks, one index_copy_ scatters them, whatever the number of layers;
- its bytes cross between the device and the pool's memory in one copy per run of consecutive
  slots, asynchronously once the pool's memory is registered with CUDA as pinned
  (`PoolMemory.register`), else through one pinned staging buffer;
- its digests are taken on the device, all blocks in one batch (integrity.block_digests), and
  compared there (a load) or copied out beside the bytes (a store): no `.item()` per block;
- on CUDA all of it is queued on a side stream (host_staging.CudaSideStream) after what the
  forward stream has queued, and the job is done once an event recorded after it has passed
  (`Copy.passed`, an event query, never a wait). Only then does a store write its headers, and
  a load say which blocks it refused. A refused block's rows are written back as they were
  (chosen on the device, where its digest is), so its cache block is left unchanged.
On CPU it is the same code without a stream: a job is done when the call returns.
`store_blocks` and `load_blocks` run one job to its end, waiting for it (tools and tests).
"""

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer.host_staging import CudaSideStream, HostRegistration
from kv_transfer.integrity import block_digests, prepare_block_digests, slice_digest

# Rows of the cache's memory narrower than this are not indexed one by one (the index would
# be a sizeable part of the bytes): such a cache is gathered one tensor at a time instead.
MIN_ROW_BYTES = 1024
MAX_REGISTER_BYTES = 64 << 30  # one cudaHostRegister call's range at most (as vLLM's offloading)
CPU_BUFFER_BYTES = 64 << 20  # each scratch buffer a CPU copier keeps between jobs, at most


def key_tag(key: bytes) -> int:
    """A block key's 64-bit tag, as a slot's header keeps it (signed, as an int64 holds it)."""
    return _signed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


@dataclass
class PoolMemory:
    """The pool's memory as this process maps it: a (tag, digest) header per part of each slot,
    and the slots as rows of bytes. `registration`: the mapping registered with CUDA (`register`),
    whose pieces each hold `slots_per_piece` slots (the first one the headers too)."""

    headers: torch.Tensor  # int64 [slots, parts, 2]
    slots: torch.Tensor  # uint8 [slots, slot bytes]
    registration: HostRegistration | None = None
    slots_per_piece: int = 0  # 0: one piece

    @classmethod
    def over(cls, buffer, header_bytes: int, slots: int, parts: int = 1) -> "PoolMemory":
        headers = torch.frombuffer(buffer, dtype=torch.int64, count=slots * parts * 2)
        data = torch.frombuffer(buffer, dtype=torch.uint8, offset=header_bytes)
        return cls(headers.view(slots, parts, 2), data.view(slots, -1))

    @property
    def parts(self) -> int:
        return self.headers.shape[1]

    @property
    def pinned(self) -> bool:
        """Registered with CUDA: copies to and from it are asynchronous."""
        return self.registration is not None and self.registration.ready

    def part(self, slot: int, part: int) -> torch.Tensor:
        """Part `part` of slot `slot`'s bytes (the whole slot for an engine without TP)."""
        size = self.slots.shape[1] // self.headers.shape[1]
        return self.slots[slot, part * size : (part + 1) * size]

    def register(self, device, wait: bool = True) -> HostRegistration:
        """Register the mapping (headers and slots) with CUDA for `device`, in pieces of whole
        slots of at most MAX_REGISTER_BYTES, so that no run of slots a job copies at once
        straddles two (`wait`: see HostRegistration)."""
        start, slot_bytes, count = self.headers.data_ptr(), self.slots.shape[1], len(self.slots)
        first = self.slots.data_ptr()
        per_piece = max(1, (MAX_REGISTER_BYTES - (first - start)) // max(1, slot_bytes))
        pieces = [(start, first - start + min(per_piece, count) * slot_bytes)]
        for slot in range(per_piece, count, per_piece):
            pieces.append((first + slot * slot_bytes, min(per_piece, count - slot) * slot_bytes))
        self.slots_per_piece = per_piece
        self.registration = HostRegistration(pieces, device, (self.headers, self.slots), wait)
        return self.registration


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A cache tensor as vLLM's offloading connector hands it over, (blocks, bytes of one
    block), viewed as bytes (never copied)."""
    if cache.dim() != 2:
        raise ValueError(f"a cache of one row per block, not of shape {tuple(cache.shape)}")
    return cache.view(torch.uint8)


def record(key: bytes, data: torch.Tensor) -> tuple[int, int]:
    """A part's header entry: its key's tag and its bytes' digest (as int64s hold them)."""
    return key_tag(key), _signed(slice_digest(data))


@dataclass
class RowGroup:
    """Cache tensors whose block rows are rows of one [rows, width] view of their memory: block
    b's bytes of them are rows `base + b * step`, in slot order (columns `start` to `end`). The
    view is of int64 elements when widths and offsets allow (index ops on a CPU move 8-byte
    elements ~7 times faster than bytes), else of bytes."""

    rows: torch.Tensor
    base: torch.Tensor  # int64, on the host
    step: torch.Tensor
    start: int
    end: int


class CacheRows:
    """An engine's cache tensors ((blocks, bytes of one block) each, `cache_rows`) as one index
    over blocks x layers: vLLM 0.32 allocates every layer in one buffer (layer l of block b at
    offset + l * layer_stride + b * block_stride: vllm/v1/worker/utils.allocate_kv_cache), so a
    job's blocks are rows of one view of it and move in one gather or scatter. Tensors in
    allocations of their own (or rows too narrow to index) are a group each."""

    def __init__(self, pages: Sequence[torch.Tensor]):
        if not pages or any(page.dim() != 2 or page.dtype != torch.uint8 for page in pages):
            raise ValueError("cache tensors as (blocks, bytes of a block) bytes: cache_rows")
        self.device = pages[0].device
        self.block_bytes = sum(page.shape[1] for page in pages)
        self.groups: list[RowGroup] = []
        start, run = 0, []
        for page in pages:
            if run and not _same_memory(run[-1], page):
                start = self._add(run, start)
                run = []
            run.append(page)
        self._add(run, start)
        for group in self.groups:
            if self._widens(group):
                group.rows = group.rows.view(torch.int64)

    def _add(self, pages: list[torch.Tensor], start: int) -> int:
        """Group `pages` (consecutive ones, in one allocation) from slot column `start`: one
        view of rows of their common width, or one group each if that width is too narrow."""
        offsets = [page.storage_offset() * page.element_size() for page in pages]
        sizes = [page.shape[1] for page in pages]
        width = math.gcd(*offsets, *(page.stride(0) for page in pages), *sizes)
        if width < MIN_ROW_BYTES or any(page.stride(1) != 1 for page in pages):
            for page in pages:
                one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
                self.groups.append(RowGroup(page, *one, start, start + page.shape[1]))
                start += page.shape[1]
            return start
        storage = pages[0].untyped_storage()
        rows = torch.empty(0, dtype=torch.uint8, device=self.device)
        rows.set_(storage, 0, (storage.nbytes() // width, width), (width, 1))
        base, step = [], []  # plain lists: no torch call per cache tensor
        for page, offset, size in zip(pages, offsets, sizes, strict=True):
            base.extend(range(offset // width, (offset + size) // width))
            step.extend([page.stride(0) // width] * (size // width))
        end = start + sum(sizes)
        as_index = torch.tensor((base, step), dtype=torch.int64)
        self.groups.append(RowGroup(rows, as_index[0], as_index[1], start, end))
        return end

    def _widens(self, group: RowGroup) -> bool:
        rows = group.rows
        return (
            rows.dim() == 2
            and rows.stride(1) == 1
            and all(n % 8 == 0 for n in (self.block_bytes, group.start, rows.shape[1]))
            and rows.stride(0) % 8 == 0
            and rows.storage_offset() % 8 == 0
        )

    def index(self, blocks: Sequence[int]) -> torch.Tensor:
        """The rows of `blocks`, group after group (int64, on the host)."""
        ids = torch.tensor(list(blocks), dtype=torch.int64).unsqueeze(1)
        found = [(ids * group.step + group.base).reshape(-1) for group in self.groups]
        return found[0] if len(found) == 1 else torch.cat(found)

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Blocks' bytes into `out` ([count, block bytes], contiguous), in slot order, from
        `index(blocks)` (on the cache's device)."""
        count = out.shape[0]
        if len(self.groups) == 1:
            group = self.groups[0]
            columns = _columns(out, group).view(-1, group.rows.shape[1])
            torch.index_select(group.rows, 0, index, out=columns)
            return out
        at = 0
        for group in self.groups:
            size = count * group.base.numel()
            found = group.rows.index_select(0, index[at : at + size])
            _columns(out, group).copy_(found.view(count, -1))
            at += size
        return out

    def scatter(self, index: torch.Tensor, data: torch.Tensor) -> None:
        """Write [count, block bytes] `data` into the blocks of `index(blocks)`."""
        at, count = 0, data.shape[0]
        for group in self.groups:
            size = count * group.base.numel()
            rows = _columns(data, group).reshape(size, group.rows.shape[1])
            group.rows.index_copy_(0, index[at : at + size], rows)
            at += size


def _columns(data: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """A group's columns of [count, block bytes] `data`, in the group's element type."""
    columns = data[:, group.start : group.end]
    return columns.view(group.rows.dtype) if group.rows.dtype != torch.uint8 else columns


def _wide(data: torch.Tensor) -> torch.Tensor:
    """[count, bytes] as 8-byte elements where its size allows (elementwise ops run faster)."""
    return data.view(torch.int64) if data.shape[1] % 8 == 0 else data


def _same_memory(page: torch.Tensor, other: torch.Tensor) -> bool:
    return page.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


_PENDING = object()


@dataclass
class Copy:
    """A queued job: `passed()` once it is done (an event query on CUDA; at once on CPU), then
    `result()` finishes it on the host (a store's headers, a load's refusals)."""

    event: object
    finish: Callable[[], object]
    held: list = field(default_factory=list)  # what the queued work reads or writes
    _result: object = _PENDING

    def passed(self) -> bool:
        return self.event is None or self.event.query()

    def result(self):
        """What the job did (only once `passed()`): a store's bytes, or a load's (bytes, refused
        blocks, their keys)."""
        if self._result is _PENDING:
            self._result = self.finish()
            self.held = []
        return self._result

    def wait(self):
        """Wait for the device, then `result()`: for tools and tests, never vLLM's thread."""
        if self.event is not None:
            self.event.synchronize()
        return self.result()


class PoolCopier:
    """Store and load jobs between `pages` (one engine rank's cache tensors) and part `part` of
    pool slots. `side`: the stream jobs are queued on (a CudaSideStream, made for a CUDA cache;
    None on CPU: a job runs in the call)."""

    def __init__(self, pages: Sequence[torch.Tensor], part: int = 0, side=None):
        self.cache = CacheRows(pages)
        self.part = part
        self.device = self.cache.device
        self.pin = self.device.type == "cuda"
        if side is None and self.pin:
            side = CudaSideStream(self.device)
        self.side = side
        self._buffers: dict[str, torch.Tensor] = {}
        prepare_block_digests(self.cache.block_bytes, self.device)

    def store(self, blocks: Sequence[int], memory: PoolMemory, slots, keys) -> Copy:
        """Copy each block into its slot's part; once done, its header gets its key's tag and
        its digest. Result: the bytes copied."""
        count, size = len(blocks), self._size(memory)
        if not count:
            return Copy(None, lambda: 0)
        index = self._host(self.cache.index(blocks))
        runs = self._runs(memory, slots)
        direct = self.side is None or memory.pinned
        digests = self._empty(count, torch.int64)
        staging = None if direct else self._empty((count, size), torch.uint8)
        held: list = [index, digests, staging, memory]

        def work() -> None:
            # Gathered where the cache is; on a CPU into the slots themselves when they are
            # one run (one pass over the bytes fewer).
            into_slots = self.side is None and len(runs) == 1
            data = runs[0][2] if into_slots else self._buffer("store", count, size)
            self.cache.gather(index.to(self.device, non_blocking=True), data)
            digests.copy_(block_digests(data), non_blocking=True)
            if staging is not None:
                staging.copy_(data, non_blocking=True)
            elif not into_slots:
                for first, end, target in runs:
                    target.copy_(data[first:end], non_blocking=True)
            held.append(data)

        def finish() -> int:
            if staging is not None:  # a host copy, of bytes already on the host
                for first, end, target in runs:
                    target.copy_(staging[first:end])
            tags = torch.tensor([key_tag(key) for key in keys], dtype=torch.int64)
            where = torch.tensor(list(slots), dtype=torch.int64)
            memory.headers[where, self.part] = torch.stack((tags, digests), 1)
            return count * size

        return Copy(self._queue(work), finish, held)

    def load(self, blocks: Sequence[int], memory: PoolMemory, slots, keys) -> Copy:
        """Copy each slot's part to the device, check it against its header there, and write
        the blocks that pass into the cache; a block that fails keeps its rows. The headers are
        read now, the bytes copied after, so bytes rewritten meanwhile fail their check.
        Result: (bytes loaded, the blocks refused, their keys)."""
        count, size = len(blocks), self._size(memory)
        if not count:
            return Copy(None, lambda: (0, [], []))
        index = self.cache.index(blocks)
        headers = memory.headers[torch.tensor(list(slots), dtype=torch.int64), self.part]
        recorded = headers[:, 0].tolist()
        tags = [int(tag == key_tag(key)) for tag, key in zip(recorded, keys, strict=True)]
        meta = self._host(torch.cat([index, headers[:, 1], torch.tensor(tags, dtype=torch.int64)]))
        runs = self._runs(memory, slots)
        staging = None
        if self.side is not None and not memory.pinned:  # a host copy, into pinned memory
            staging = self._empty((count, size), torch.uint8)
            for first, end, source in runs:
                staging[first:end].copy_(source)
        passed = self._empty(count, torch.bool)
        held: list = [meta, staging, passed, memory]

        def work() -> None:
            on_device = meta.to(self.device, non_blocking=True)
            rows = index.numel()
            where, expected = on_device[:rows], on_device[rows : rows + count]
            data = self._buffer("load", count, size)
            if staging is not None:
                data.copy_(staging, non_blocking=True)
            else:
                for first, end, source in runs:
                    data[first:end].copy_(source, non_blocking=True)
            good = (block_digests(data) == expected) & (on_device[rows + count :] != 0)
            passed.copy_(good, non_blocking=True)
            if self.side is None and all(passed.tolist()):  # a CPU's verdict costs no wait
                self.cache.scatter(where, data)
                return
            # A refused block's rows are written back as they are: chosen on the device, where
            # its verdict is, not on this thread (which would wait for it).
            kept = self.cache.gather(where, self._buffer("kept", count, size))
            wide, old = _wide(data), _wide(kept)
            torch.where(good.unsqueeze(1), wide, old, out=old)
            self.cache.scatter(where, kept)
            held.extend((on_device, data, kept))

        def finish() -> tuple[int, list[int], list[bytes]]:
            verdicts = passed.tolist()
            refused = [i for i, good in enumerate(verdicts) if not good]
            loaded = (count - len(refused)) * size
            return loaded, [int(blocks[i]) for i in refused], [keys[i] for i in refused]

        return Copy(self._queue(work), finish, held)

    def fence(self) -> None:
        """The forward stream waits (on the device, not this thread) for every job queued so
        far: vLLM is about to reuse blocks a queued store still reads."""
        if self.side is not None:
            self.side.precede_forward()

    def _queue(self, work: Callable[[], None]):
        """Run `work` at once (CPU), or queue it on the side stream after what the forward
        stream has queued: the event it passes once done."""
        if self.side is None:
            work()
            return None
        self.side.follow_forward()
        self.side.submit(work)
        return self.side.record()

    def _size(self, memory: PoolMemory) -> int:
        size = memory.slots.shape[1] // memory.parts
        if size != self.cache.block_bytes:
            raise ValueError(f"a {self.cache.block_bytes} B block in a {size} B part of a slot")
        return size

    def _runs(self, memory: PoolMemory, slots) -> list[tuple[int, int, torch.Tensor]]:
        """(first, end, host view): jobs' blocks first..end go to or from consecutive slots, of
        one registered piece: one copy each (a block each in a slot of several parts)."""
        slots = [int(slot) for slot in slots]
        per_piece = memory.slots_per_piece or len(memory.slots)
        runs, first = [], 0
        for i in range(1, len(slots) + 1):
            if (
                i < len(slots)
                and memory.parts == 1
                and slots[i] == slots[i - 1] + 1
                and slots[i] // per_piece == slots[first] // per_piece
            ):
                continue
            slot = slots[first]
            if memory.parts == 1:
                view = memory.slots[slot : slot + i - first]
            else:
                view = memory.part(slot, self.part).unsqueeze(0)
            runs.append((first, i, view))
            first = i
        return runs

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor a device copy reads: pinned beside CUDA (else the copy would wait)."""
        return tensor.pin_memory() if self.pin else tensor

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def _buffer(self, name: str, count: int, size: int) -> torch.Tensor:
        """[count, size] bytes where the cache is, for a job's work: on a device, from the
        side stream's memory (held by the job until it is done); on a CPU, a buffer kept for
        the next job (a fresh one of tens of MiB costs more in page faults than its copy)."""
        if self.side is not None or count * size > CPU_BUFFER_BYTES:
            return torch.empty((count, size), dtype=torch.uint8, device=self.device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < count * size:
            buffer = self._buffers[name] = torch.empty(count * size, dtype=torch.uint8)
        return buffer[: count * size].view(count, size)


def store_blocks(
    pages: list[torch.Tensor], blocks: list[int], memory: PoolMemory, slots, keys, part: int = 0
) -> int:
    """Copy each cache block into part `part` (this rank's) of its slot and record its key and
    digest, as one job run to its end (it waits for the device: tools and tests; an engine's
    worker queues a PoolCopier job and polls it). The bytes copied."""
    return PoolCopier(pages, part).store(blocks, memory, slots, keys).wait()


def load_blocks(
    pages: list[torch.Tensor], blocks: list[int], memory: PoolMemory, slots, keys, part: int = 0
) -> tuple[int, list[int], list[bytes]]:
    """Copy part `part` (this rank's) of each slot that passes its check into its cache block,
    as one job run to its end (see store_blocks): (bytes copied, the blocks refused, their
    keys). A refused block's cache rows are left as they were."""
    return PoolCopier(pages, part).load(blocks, memory, slots, keys).wait()


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
