"""The host KV pool's batched copier (kv_transfer/pool/copy.py): a cache allocated as vLLM 0.32
allocates it is one index over blocks x layers whatever its layout, and caches allocated apart
still land in the same slot layout; the device digests are slice_digest's, bit for bit; on a
stream (a fake one here, whose events pass when told, as host_staging.CudaSideStream's do on
CUDA) a job is finished by an event query, its headers written only then, and a load's refused
block is known only then and left as it was, with no synchronising call on the way."""

import pytest
import torch

from kv_transfer.integrity import _signed, block_digests, slice_digest
from kv_transfer.pool.copy import (
    MIN_ROW_BYTES,
    CacheRows,
    PoolCopier,
    cache_rows,
    key_tag,
    load_blocks,
    store_blocks,
)
from tests.unit.kv_pool_copies import PAGE, block_bytes, count, keys_for, pool, vllm_cache

__all__ = ["count"]  # the fixture, used by name


@pytest.mark.parametrize("cross_layer", [False, True], ids=["layer-major", "cross-layer"])
def test_a_vllm_cache_is_one_row_group_whatever_its_layout(cross_layer):
    pages = vllm_cache(6, 5, cross_layer)
    rows = CacheRows(pages)
    assert len(rows.groups) == 1 and rows.groups[0].rows.dtype == torch.int64
    memory, keys = pool(3, 5 * PAGE), keys_for(3)
    store_blocks(pages, [4, 0, 2], memory, [0, 1, 2], keys)
    for slot, block in enumerate([4, 0, 2]):
        assert torch.equal(memory.slots[slot], block_bytes(pages, block))
    assert load_blocks(pages, [1, 3, 5], memory, [0, 1, 2], keys)[1] == []
    for source, target in zip([4, 0, 2], [1, 3, 5], strict=True):
        assert torch.equal(block_bytes(pages, source), block_bytes(pages, target))


def test_caches_in_separate_allocations_or_narrow_rows_are_a_group_each_and_still_exact():
    """Tensors allocated apart (or too narrow to index row by row, or of odd widths) are
    gathered one group at a time, into the same slot layout."""
    pages = [
        cache_rows(torch.randint(0, 256, (4, 3 * PAGE), dtype=torch.uint8)),
        cache_rows(torch.randn(4, PAGE // 2, dtype=torch.float16)),
        cache_rows(torch.randint(0, 256, (4, MIN_ROW_BYTES // 2 + 3), dtype=torch.uint8)),
    ]
    assert len(CacheRows(pages).groups) == 3
    size = sum(page.shape[1] for page in pages)
    memory, keys = pool(2, 2 * size, parts=2), keys_for(2)  # this rank's part: the second
    store_blocks(pages, [3, 1], memory, [1, 0], keys, part=1)
    assert torch.equal(memory.part(1, 1), block_bytes(pages, 3))
    assert load_blocks(pages, [0, 2], memory, [1, 0], keys, part=1)[1] == []
    assert torch.equal(block_bytes(pages, 0), block_bytes(pages, 3))
    assert torch.equal(block_bytes(pages, 2), block_bytes(pages, 1))


@pytest.mark.parametrize("size", [1, 8, 100, 4096, 4097, 3 * 4096, 12345])
def test_device_digests_are_slice_digests_bit_for_bit(size):
    rows = torch.randint(0, 256, (3, size), dtype=torch.uint8)
    expected = [_signed(slice_digest(row)) for row in rows]
    assert block_digests(rows).tolist() == expected
    wider = torch.randint(0, 256, (3, size + 11), dtype=torch.uint8)
    wider[:, 3 : 3 + size] = rows  # a strided, unaligned view: the same digests
    assert block_digests(wider[:, 3 : 3 + size]).tolist() == expected


# A side stream as host_staging.CudaSideStream drives it, whose events pass when told.


class HeldEvent:
    def __init__(self, stream: "HeldStream"):
        self.stream = stream

    def query(self) -> bool:
        return self.stream.released

    def synchronize(self) -> None:
        self.stream.syncs += 1


class HeldStream:
    """Runs queued work at once (the bytes move on CPU), but its events pass only once
    `released`: a job is finished by a later event query, as on CUDA."""

    def __init__(self):
        self.released = False
        self.syncs = self.fences = self.follows = 0

    def follow_forward(self) -> None:
        self.follows += 1

    def submit(self, work) -> None:
        work()

    def record(self) -> HeldEvent:
        return HeldEvent(self)

    def synchronize(self) -> None:
        self.syncs += 1

    def precede_forward(self) -> None:
        self.fences += 1


class Registered:
    """A registration that is done (pinned memory: copies go straight to and from the slots)."""

    ready = True


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned pool", "staged"])
def test_on_a_stream_a_job_is_finished_by_an_event_query_never_a_wait(count, pinned):
    stream = HeldStream()
    pages = vllm_cache(16, 32)
    memory, keys = pool(8, 32 * PAGE), keys_for(8)
    memory.registration = Registered() if pinned else None
    copier = PoolCopier(pages, side=stream)
    store, calls = count(lambda: copier.store(list(range(8)), memory, list(range(8)), keys))
    assert calls.syncs == 0 and stream.follows == 1, calls
    assert not store.passed()
    assert memory.headers.count_nonzero() == 0  # no header before the bytes are known to land
    copier.fence()
    assert stream.fences == 1 and stream.syncs == 0
    stream.released = True
    assert store.passed()
    assert store.result() == 8 * 32 * PAGE
    for slot in range(8):
        tag, digest = memory.headers[slot, 0].tolist()
        assert (tag, digest) == (key_tag(keys[slot]), _signed(slice_digest(memory.slots[slot])))

    stream.released = False
    memory.slots[2, 5] ^= 1  # block 2's bytes changed in the pool
    before = block_bytes(pages, 10)
    load, calls = count(lambda: copier.load(list(range(8, 16)), memory, list(range(8)), keys))
    assert calls.syncs == 0 and not load.passed(), calls
    stream.released = True
    loaded, refused, refused_keys = load.result()
    assert (refused, refused_keys) == ([10], [keys[2]])
    assert loaded == 7 * 32 * PAGE
    assert torch.equal(block_bytes(pages, 10), before)  # left as it was
    for source in (0, 1, 3, 4, 5, 6, 7):
        assert torch.equal(block_bytes(pages, source), block_bytes(pages, source + 8))
    assert stream.syncs == 0
