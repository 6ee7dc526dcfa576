"""KV blocks between an engine's cache and the host pool's memory (kv_transfer/pool_store.py),
with the writer's record and the reader's check: plain torch (no vLLM, no numpy), so the same
code runs in the engine (kv_transfer/pool_offload.py) and in scripts/gpu_check.py on a device.

A slot holds one block: its rows of every cache tensor, back to back; for a tensor-parallel
engine, one part per rank (rank r's rows, at r part-lengths in), which that rank alone writes and
reads. Each part's header entry holds the block key's tag and the digest of the part's bytes
(kv_transfer/integrity.py), written after the bytes. A reader checks both on its own copy of
its part before one byte reaches its cache:
a slot that holds another key (evicted and reused, a store from another epoch) or other bytes
(damaged memory, a writer that died mid-copy or is writing it now) is refused. On a GPU a block
crosses PCIe once each way and its digest is taken on the device; the pool's memory is ordinary
shared memory, not pinned, so those copies are synchronous and slower than they could be.
"""

import hashlib
from dataclasses import dataclass

import torch

from kv_transfer.integrity import slice_digest


def key_tag(key: bytes) -> int:
    """A block key's 64-bit tag, as a slot's header keeps it (signed, as an int64 holds it)."""
    return _signed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))


@dataclass
class PoolMemory:
    """The pool's memory as this process maps it: a (tag, digest) header per part of each slot,
    and the slots as rows of bytes."""

    headers: torch.Tensor  # int64 [slots, parts, 2]
    slots: torch.Tensor  # uint8 [slots, slot bytes]

    @classmethod
    def over(cls, buffer, header_bytes: int, slots: int, parts: int = 1) -> "PoolMemory":
        headers = torch.frombuffer(buffer, dtype=torch.int64, count=slots * parts * 2)
        data = torch.frombuffer(buffer, dtype=torch.uint8, offset=header_bytes)
        return cls(headers.view(slots, parts, 2), data.view(slots, -1))

    def part(self, slot: int, part: int) -> torch.Tensor:
        """Part `part` of slot `slot`'s bytes (the whole slot for an engine without TP)."""
        size = self.slots.shape[1] // self.headers.shape[1]
        return self.slots[slot, part * size : (part + 1) * size]


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A cache tensor as vLLM's offloading connector hands it over, (blocks, bytes of one
    block), viewed as bytes (never copied)."""
    if cache.dim() != 2:
        raise ValueError(f"a cache of one row per block, not of shape {tuple(cache.shape)}")
    return cache.view(torch.uint8)


def record(key: bytes, data: torch.Tensor) -> tuple[int, int]:
    """A part's header entry: its key's tag and its bytes' digest (as int64s hold them)."""
    return key_tag(key), _signed(slice_digest(data))


def store_blocks(
    pages: list[torch.Tensor], blocks: list[int], memory: PoolMemory, slots, keys, part: int = 0
) -> int:
    """Copy each cache block into part `part` (this rank's) of its slot and record its key and
    digest; the bytes copied. On a GPU a block's rows are gathered and digested where the cache
    lives (only the 8-byte digest and one copy of the block cross to the host); on a CPU they
    are copied straight into the slot and the slot is digested (one pass fewer over the
    block's bytes than gathering them first)."""
    copied = 0
    for block, slot, key in zip(blocks, slots, keys, strict=True):
        target = memory.part(slot, part)
        if pages[0].device.type == "cpu":
            offset = 0
            for page in pages:
                target[offset : offset + page.shape[1]].copy_(page[int(block)])
                offset += page.shape[1]
            data = target
        else:
            data = torch.cat([page[int(block)] for page in pages])
            target.copy_(data)
        memory.headers[slot, part, 0], memory.headers[slot, part, 1] = record(key, data)
        copied += data.numel()
    return copied


def load_blocks(
    pages: list[torch.Tensor], blocks: list[int], memory: PoolMemory, slots, keys, part: int = 0
) -> tuple[int, list[int], list[bytes]]:
    """Copy part `part` (this rank's) of each slot that passes its check into its cache block:
    (bytes copied, the blocks refused, their keys). A refused block's cache rows are left as
    they were. The check is of what is used: the part is first copied to where the cache lives
    (one host-to-device copy on a GPU, where the digest is then taken), then that copy is
    checked and loaded, so a writer reusing the slot meanwhile (its pin lost with a connection)
    cannot slip in bytes that were not checked."""
    copied, refused_blocks, refused_keys = 0, [], []
    size = memory.part(0, part).numel()
    staging = torch.empty(size, dtype=torch.uint8, device=pages[0].device)
    for block, slot, key in zip(blocks, slots, keys, strict=True):
        recorded = (int(memory.headers[slot, part, 0]), int(memory.headers[slot, part, 1]))
        staging.copy_(memory.part(slot, part))
        if recorded != record(key, staging):
            refused_blocks.append(int(block))
            refused_keys.append(key)
            continue
        offset = 0
        for page in pages:
            page[int(block)].copy_(staging[offset : offset + page.shape[1]])
            offset += page.shape[1]
        copied += offset
    return copied, refused_blocks, refused_keys


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
