"""The host KV pool's copies (kv_transfer/pool/copy.py) never make the thread that asks for them
wait for the device, which in an engine is vLLM's: counted at torch's dispatcher on CPU, a store
or load job of 8 blocks x 32 layers makes no synchronising call (no `.item()` or `int()` of a
tensor, no stream or event synchronize) and as many copy launches as one of 2 blocks x 4 layers
(O(1) per job: one gather or scatter over blocks x layers, one copy per run of consecutive
slots, the digests in one batch). A corrupted block is refused (its cache rows left as they
were). The fake stream and the layouts are tested in test_kv_pool_batched.py; this file uses
only what the copier had before (store_blocks, load_blocks), so it reads the same before and
after it."""

import mmap
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kv_transfer.pool.copy import PoolMemory, cache_rows, load_blocks, store_blocks
from kv_transfer.pool.store import header_bytes

PAGE = 2048  # one block's bytes of one layer
# The dispatcher's names of what copies bytes (one launch each on a device).
COPIES = {
    "copy_",
    "index_select",
    "index_copy_",
    "index_put_",
    "cat",
    "stack",
    "_to_copy",
    "clone",
    "where",
    "gather",
    "scatter",
    "constant_pad_nd",
}
SYNC = "_local_scalar_dense"  # .item(), int(), float(), bool() of a tensor: a device sync
MOST_COPIES = 8  # a job's copy launches, whatever its blocks and layers (one slot run)


@dataclass
class Calls:
    syncs: int  # synchronising calls
    copies: int  # copy launches
    ops: int  # every dispatched op
    detail: dict

    def __str__(self) -> str:
        copies = {name: n for name, n in self.detail.items() if name in COPIES}
        return f"{self.syncs} sync(s), {self.copies} copy launch(es) {copies}, {self.ops} ops"


class Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count(monkeypatch):
    """count(run) -> (run's result, Calls): what `run` dispatched, and the explicit syncs."""
    explicit: Counter = Counter()

    def counting(name, original):
        def counted(*args, **kwargs):
            explicit[name] += 1
            return original(*args, **kwargs)

        return counted

    monkeypatch.setattr(torch.Tensor, "item", counting("item", torch.Tensor.item))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda", torch.cuda.synchronize))
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(owner, "synchronize", counting(owner.__name__, owner.synchronize))

    def run_counted(run):
        explicit.clear()
        with Dispatched() as dispatched:
            result = run()
        syncs = dispatched.ops[SYNC] + explicit["cuda"] + explicit["Event"] + explicit["Stream"]
        syncs += explicit["item"] if not dispatched.ops[SYNC] else 0  # item() dispatches SYNC
        copies = sum(n for name, n in dispatched.ops.items() if name in COPIES)
        total = sum(dispatched.ops.values())
        return result, Calls(syncs, copies, total, dict(dispatched.ops) | dict(explicit))

    return run_counted


def vllm_cache(blocks: int, layers: int, cross_layer: bool = False) -> list[torch.Tensor]:
    """Cache tensors as vLLM 0.32 allocates them: one int8 buffer, each layer a (blocks, page)
    view of it, layer by layer (LB*) or block by block (BL*, cross-layer), random bytes."""
    buffer = torch.randint(-128, 128, (layers * blocks * PAGE,), dtype=torch.int8)
    if cross_layer:
        per_block = buffer.view(blocks, layers, PAGE)
        return [cache_rows(per_block[:, layer]) for layer in range(layers)]
    return [cache_rows(layer.view(blocks, PAGE)) for layer in buffer.view(layers, -1)]


def pool(slots: int, slot_bytes: int, parts: int = 1) -> PoolMemory:
    start = header_bytes(slots, parts)
    return PoolMemory.over(mmap.mmap(-1, start + slots * slot_bytes), start, slots, parts)


def keys_for(blocks: int) -> list[bytes]:
    return [f"key {i}".encode() for i in range(blocks)]


def block_bytes(pages: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([page[block] for page in pages])


def job_calls(count, blocks: int, layers: int, slots: list[int]) -> tuple[Calls, Calls]:
    """One store job of `blocks` blocks into `slots`, then one load job of them into other
    blocks of the cache: each job's calls. The load lands bit for bit."""
    pages = vllm_cache(2 * blocks, layers)
    memory, keys = pool(max(slots) + 1, layers * PAGE), keys_for(blocks)
    sources, targets = list(range(blocks)), list(range(blocks, 2 * blocks))
    stored, store = count(lambda: store_blocks(pages, sources, memory, slots, keys))
    result, load = count(lambda: load_blocks(pages, targets, memory, slots, keys))
    assert stored == blocks * layers * PAGE
    assert result == (blocks * layers * PAGE, [], [])
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(block_bytes(pages, source), block_bytes(pages, target))
    return store, load


def test_a_job_of_8_blocks_x_32_layers_makes_no_sync_and_the_copies_of_2_x_4(count):
    """Before the batched copier a store job made one .item() per block (8) and one copy per
    block and layer (256), a load the same plus one copy per block, and two int() of its
    header per block: they grew with blocks x layers. Now both are constant, syncs 0."""
    small = job_calls(count, 2, 4, [0, 1])
    large = job_calls(count, 8, 32, list(range(8)))
    for name, few, many in zip(("store", "load"), small, large, strict=True):
        assert many.syncs == 0, f"a {name} of 8 blocks x 32 layers: {many}"
        assert many.copies <= MOST_COPIES, f"a {name} of 8 blocks x 32 layers: {many}"
        assert (many.copies, many.ops) == (few.copies, few.ops), (
            f"a {name}: 2 blocks x 4 layers {few}; 8 x 32 {many}"
        )


def test_blocks_in_scattered_slots_cost_one_copy_per_run_of_slots_not_per_layer(count):
    """Slots that are not consecutive are copied one run at a time: 8 blocks in 8 runs cost
    about 8 copies more than in one, whatever the layers."""
    one_run = job_calls(count, 8, 32, list(range(8)))
    eight_runs = job_calls(count, 8, 32, list(range(0, 16, 2)))
    for together, apart in zip(one_run, eight_runs, strict=True):
        assert apart.syncs == 0
        assert together.copies < apart.copies <= together.copies + 2 * 8, (together, apart)


def test_a_corrupted_block_or_another_keys_slot_is_refused_and_its_rows_kept():
    pages = vllm_cache(12, 8)
    memory, keys = pool(6, 8 * PAGE), keys_for(6)
    store_blocks(pages, list(range(6)), memory, list(range(6)), keys)
    memory.slots[1, 8 * PAGE - 1] ^= 0x80  # the last byte of block 1
    memory.headers[3, 0, 1] ^= 1  # block 3's recorded digest
    slots = [0, 1, 2, 3, 4, 4]  # the last reads key 4's slot for key 5
    before = [block_bytes(pages, block) for block in range(6, 12)]
    loaded, refused, refused_keys = load_blocks(pages, list(range(6, 12)), memory, slots, keys)
    assert (refused, refused_keys) == ([7, 9, 11], [keys[1], keys[3], keys[5]])
    assert loaded == 3 * 8 * PAGE
    for block in (7, 9, 11):
        assert torch.equal(block_bytes(pages, block), before[block - 6])
    for block in (6, 8, 10):
        assert torch.equal(block_bytes(pages, block), block_bytes(pages, block - 6))
