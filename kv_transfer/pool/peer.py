"""KV blocks between two hosts' pools: a worker whose own pool lacks a prompt's prefix that
another host's pool holds copies those blocks into its pool before its engine looks the prompt
up, so the engine loads them (kv_transfer/pool/offload.py) instead of computing them.

Both ends are a worker's own process (not its engine), connected to its host's store as a peer
(kv_transfer/pool/store.py's PEER: whatever the pool holds, with the pool's memory mapped).
The source pins the blocks it reads, so none is evicted or rewritten while it is sent
(`read_blocks`), and sends each block's bytes with its header: each part's key tag and digest,
as the engine that computed it wrote them. The destination writes the bytes into slots it took
for the keys (`BlockWriter`), checks every part against its key and digest before the block
becomes loadable, and only then writes the header; a block that fails is never loadable, is
counted, and its prompt's tokens are computed. The engine checks the header again when it loads
(kv_transfer/pool/copy.py), as for any block of its pool.

Chunks carry at most CHUNK_BYTES (a 70B model's block of 128 tokens over 8 ranks is ~40 MiB),
and nothing here waits: the caller (pdserve/worker/pool_peers.py) bounds the fetch by what
computing the tokens would take, and whatever arrived by then is kept.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.copy import PoolMemory, record
from kv_transfer.pool.wire import CompleteLoad, CompleteStore, Lookup, PrepareLoad, PrepareStore

CHUNK_BYTES = 4 << 20


@dataclass
class BlockChunk:
    """Bytes of one block sent from a pool (pdserve's worker protocol: PoolBlockChunk):
    `block` indexes the keys asked for; a block's first chunk (offset 0) carries its header,
    (tag, digest) per part."""

    block: int
    offset: int
    data: bytes
    header: list[int] = field(default_factory=list)


def read_blocks(client: PoolClient, keys: tuple[bytes, ...]) -> Iterator[BlockChunk]:
    """The leading `keys` the pool holds, chunk by chunk, pinned until the last is read (or
    the reader stops: closing the generator unpins them)."""
    found = client.call(Lookup(keys))
    held = keys[: found.blocks] if found else ()
    pinned = client.call(PrepareLoad(held)) if held else None
    if not pinned or not pinned.slots:
        return
    try:
        # The store's memory as planned: the client may reconnect while the chunks are read.
        memory, start, slot_bytes = client.memory, client.header_bytes, client.slot_bytes
        headers = PoolMemory.over(memory, start, client.slots, client.parts).headers
        for block, slot in enumerate(pinned.slots):
            header = headers[slot].reshape(-1).tolist()
            base = start + slot * slot_bytes
            for offset in range(0, slot_bytes, CHUNK_BYTES):
                end = min(offset + CHUNK_BYTES, slot_bytes)
                data = memory[base + offset : base + end]
                yield BlockChunk(block, offset, data, header if offset == 0 else [])
    finally:
        client.call(CompleteLoad(held))


class Damaged(ValueError):
    """A block's bytes or header are not what its key and digest say: the fetch stops."""


class BlockWriter:
    """The destination: slots for `keys` in this host's pool (those it lacks, in order:
    `wanted`), filled by the chunks a peer sends and checked before any becomes loadable.
    `finish` (on every path) makes the checked blocks loadable and frees the others' slots."""

    def __init__(self, client: PoolClient, keys: tuple[bytes, ...]):
        self.client = client
        reserved = client.call(PrepareStore(keys)) if keys else None
        stored = reserved.stored if reserved else None
        self.wanted = stored.keys if stored else ()
        self.slots = stored.slots if stored else ()
        self.written = 0  # bytes of the block being written
        self.checked: list[bytes] = []  # blocks that passed their check, in order
        if self.wanted:
            self.buffer, self.base = client.memory, client.header_bytes
            self.memory = PoolMemory.over(self.buffer, self.base, client.slots, client.parts)
            self.store_id = client.store_id

    def write(self, chunk: BlockChunk) -> None:
        """Copy a chunk into its slot (chunks come block by block, in order); a block's last
        chunk is checked, part by part, against its key and digest. Damaged: a chunk out of
        order, or a block that fails its check."""
        block, slot_bytes = len(self.checked), self.memory.slots.shape[1]
        parts = self.memory.headers.shape[1]
        if chunk.block != block or chunk.offset != self.written or block >= len(self.wanted):
            expected = f"{block}@{self.written}"
            raise Damaged(f"chunk {chunk.block}@{chunk.offset}, expected {expected}")
        if chunk.offset == 0:
            if len(chunk.header) != 2 * parts:
                raise Damaged(f"a header of {len(chunk.header)} numbers for {parts} parts")
            self.header = list(chunk.header)
        end = self.written + len(chunk.data)
        if end > slot_bytes or not chunk.data:
            raise Damaged(f"{end} bytes of a {slot_bytes} B block")
        slot, key = self.slots[block], self.wanted[block]
        start = self.base + slot * slot_bytes
        self.buffer[start + self.written : start + end] = chunk.data
        self.written = end
        if end < slot_bytes:
            return
        for part in range(parts):
            recorded = (self.header[2 * part], self.header[2 * part + 1])
            if recorded != record(key, self.memory.part(slot, part)):
                raise Damaged(f"block {block}, part {part}: not its key's bytes")
        for part in range(parts):
            self.memory.headers[slot, part, 0] = self.header[2 * part]
            self.memory.headers[slot, part, 1] = self.header[2 * part + 1]
        self.checked.append(key)
        self.written = 0

    def finish(self) -> int:
        """The blocks made loadable; the slots of the rest are freed (a store restarted since
        refuses both: its new slots were never written)."""
        if not self.wanted:
            return 0
        unwritten = self.wanted[len(self.checked) :]
        if self.client.store_id != self.store_id:
            return 0
        if self.checked:
            self.client.call(CompleteStore(tuple(self.checked), success=True))
        if unwritten:
            self.client.call(CompleteStore(unwritten, success=False))
        return len(self.checked)
