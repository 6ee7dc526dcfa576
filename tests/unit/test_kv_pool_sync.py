"""The host KV pool's copies (kv_transfer/pool/copy.py) never make the thread that asks for them
wait for the device, which in an engine is vLLM's: counted at torch's dispatcher on CPU, a store
or load job of 8 blocks x 32 layers makes no synchronising call (no `.item()` or `int()` of a
tensor, no stream or event synchronize) and as many copy launches as one of 2 blocks x 4 layers
(O(1) per job: one gather or scatter over blocks x layers, one copy per run of consecutive
slots, the digests in one batch). A corrupted block is refused (its cache rows left as they
were). The fake stream and the layouts are tested in test_kv_pool_batched.py; this file uses
only what the copier had before (store_blocks, load_blocks), so it reads the same before and
after it."""

import torch

from kv_transfer.pool.copy import load_blocks, store_blocks
from tests.unit.kv_pool_copies import (
    MOST_COPIES,
    PAGE,
    Calls,
    block_bytes,
    count,
    keys_for,
    pool,
    vllm_cache,
)

__all__ = ["count"]  # the fixture, used by name


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
