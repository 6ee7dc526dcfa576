"""Pinned host memory stays within its budget (review §3.7): the KV send buffer's pinned
buffers and a decode rank's pinned receive buffers are carved out of blocks pinned once
(kv_transfer/host_staging.PinnedArena), first-fit and merged back, so whatever slice sizes
come, what is pinned is the budget (torch's host allocator keeps every buffer it ever pinned,
by power-of-two size: a pool of per-size buffers grew to the sum of the peaks, and a fresh
buffer per received slice to about twice the inbox). On CPU the arena carves ordinary memory:
the same bookkeeping."""

import random
import threading
import time

import pytest
import torch

from kv_transfer.host_staging import (
    ARENA_ALIGN,
    HostToDevice,
    PinnedArena,
    PinnedPool,
    StagingError,
)
from kv_transfer.transport import Inbox, LayerSlice

MIB = 1 << 20


def test_the_blocks_are_the_capacitys_powers_of_two_never_more_than_it():
    arena = PinnedArena(300 * MIB, pin=False)
    assert arena.sizes == [256 * MIB, 32 * MIB, 8 * MIB, 4 * MIB]
    assert arena.pinned_bytes() == 0  # nothing pinned before the first use
    arena.reserve()
    assert arena.pinned_bytes() == 300 * MIB
    assert PinnedArena(256 * MIB, pin=False).sizes == [256 * MIB]
    assert sum(PinnedArena(1000 * MIB + 12345, pin=False).sizes) <= 1000 * MIB + 12345


def test_any_mix_of_sizes_stays_within_the_capacity_and_merges_back_whole():
    arena = PinnedArena(64 * MIB, pin=False)
    draw = random.Random(46)
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and (draw.random() < 0.45 or arena.in_use > 48 * MIB):
            arena.give(held.pop(draw.randrange(len(held))))
            continue
        buffer = arena.take(draw.randint(1, 8 * MIB))
        if buffer is not None:
            assert buffer.numel() % ARENA_ALIGN == 0
            held.append(buffer)
        assert arena.in_use <= arena.capacity and arena.pinned_bytes() == 64 * MIB
    starts = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in held)
    assert all(end <= start for (_, end), (start, _) in zip(starts, starts[1:], strict=False))
    for buffer in held:
        assert arena.give(buffer)
    assert arena.in_use == 0 and arena.free == [[(0, 64 * MIB)]]  # one range again
    assert 0 < arena.peak <= 64 * MIB


def test_a_buffer_it_did_not_make_is_not_taken_back():
    arena = PinnedArena(4 * MIB, pin=False)
    assert not arena.give(torch.empty(16, dtype=torch.uint8))
    assert arena.take(5 * MIB) is None  # larger than any block


def test_the_send_pool_waits_for_a_range_that_holds_the_slice_and_refuses_one_too_large():
    pool = PinnedPool(8 * MIB, pin=False)
    first, second = pool.acquire(3 * MIB), pool.acquire(3 * MIB)
    assert pool.in_use == 6 * MIB
    with pytest.raises(StagingError, match="stayed full"):
        pool.acquire(4 * MIB, timeout_s=0.1)  # 2 MiB free: no range holds 4
    threading.Timer(0.1, pool.release, [second]).start()  # 5 MiB together with the free 2
    started = time.monotonic()
    third = pool.acquire(4 * MIB, timeout_s=5)
    assert time.monotonic() - started >= 0.09
    with pytest.raises(StagingError, match="largest block"):
        pool.acquire(9 * MIB)
    for buffer in (first, third):
        pool.release(buffer)
    assert pool.in_use == 0 and pool.arena.in_use == 0
    assert pool.arena.pinned_bytes() == 8 * MIB


def test_receive_buffers_come_from_the_arena_and_go_back_when_their_slice_is_released():
    """The KV loader gives the inbox the arena's free (decode_workers/kv_loader.py)."""
    staging = HostToDevice(torch.device("cpu"))
    staging.pin, staging.arena = True, PinnedArena(4 * MIB, pin=False)  # CUDA's path, on CPU
    inbox = Inbox(max_bytes=4 * MIB, verify=False)
    inbox.new_buffer = staging.receive_buffer
    inbox.free_buffer = staging.free_receive_buffer
    sizes = [MIB, 512 << 10, 2 * MIB]
    for size in sizes:
        data = inbox.buffer(size)
        assert isinstance(data, memoryview) and len(data) == size
        inbox.put(LayerSlice("t", 0, 0, 1, 0, 1, data, True))
    assert staging.pinned_stats()["pinned_in_use"] >= sum(sizes)
    assert staging.pinned_stats()["pinned_bytes"] == 4 * MIB  # the inbox's size, no more
    for arrived in inbox.take()[0]:
        arrived.release()
    assert staging.arena.in_use == 0 and inbox.held == 0
    assert not staging.free_receive_buffer(bytearray(4))  # not one of its buffers
