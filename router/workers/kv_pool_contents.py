"""What each host KV pool holds: the router keeps a copy of every pool's loadable block keys,
brought up to date by its workers' Stats (pdserve/worker/pool_contents.py asks the store for
the changes after the copy's change number), so a load from the pool is priced on what the pool
holds now (its evictions, dropped blocks and a restarted store included), and every router
prices it alike.

A pool is named by its workers' host_id and kv_pool (their Health). The router computes a
prompt's keys as the engine does (pdserve/core/pool_keys.py), from the block size and the first
parent its workers report. The copy trails the store by at most one Stats poll
(router/workers/load.py's LOAD_POLL_S).
"""

from dataclasses import dataclass, field

from pdserve.core.pool_keys import block_keys
from pdserve.protocol import worker_pb2
from router.workers.handle import WorkerHandle


@dataclass
class PoolCopy:
    """One pool's loadable keys as of change `sequence` of its store `store_id`."""

    store_id: str = ""
    sequence: int = 0
    keys: set[bytes] = field(default_factory=set)
    block_size: int = 0
    none_hash: bytes = b""


class PromptKeys:
    """A prompt's block keys for one block size and first parent, computed as far as asked (a
    pool that lacks the first block costs one hash, whatever the prompt's length)."""

    def __init__(self, prompt: tuple[int, ...], block_size: int, none_hash: bytes):
        self._more = block_keys(list(prompt), block_size, none_hash)
        self._known: list[bytes] = []

    def key(self, index: int) -> bytes | None:
        """The key of block `index`, None past the prompt's last whole block."""
        while len(self._known) <= index:
            key = next(self._more, None)
            if key is None:
                return None
            self._known.append(key)
        return self._known[index]


PoolName = tuple[str, str]  # a host KV pool: its workers' (host_id, kv_pool)


def pool_name(worker: WorkerHandle) -> PoolName:
    return worker.identity.host_id, worker.identity.kv_pool


class PoolContents:
    def __init__(self) -> None:
        self._pools: dict[PoolName, PoolCopy] = {}

    def stats_request(self, worker: WorkerHandle) -> worker_pb2.StatsRequest:
        """The Stats question for `worker`: the changes after this router's copy of its pool."""
        if not worker.identity.kv_pool:
            return worker_pb2.StatsRequest()
        copy = self._pools.get(pool_name(worker), PoolCopy())
        return worker_pb2.StatsRequest(
            kv_pool_contents=True, kv_pool_store_id=copy.store_id, kv_pool_since=copy.sequence
        )

    def update(self, worker: WorkerHandle, contents: worker_pb2.KvPoolContents) -> None:
        """A worker's answer: applied when it continues this copy (the changes after its
        change number) or replaces it (reset); an answer to an older question, which a
        pool-mate's answer overtook, is left for the next poll."""
        if not worker.identity.kv_pool:
            return
        copy = self._pools.setdefault(pool_name(worker), PoolCopy())
        if contents.reset:
            copy.keys = set(contents.added)
        elif (contents.store_id, contents.since) == (copy.store_id, copy.sequence):
            copy.keys.difference_update(contents.removed)
            copy.keys.update(contents.added)
        else:
            return
        copy.store_id, copy.sequence = contents.store_id, contents.sequence
        copy.block_size, copy.none_hash = contents.block_size, contents.none_hash

    def lost(self, worker: WorkerHandle) -> None:
        """`worker` could not say what its pool holds (its store is gone or hung): the copy
        goes, and the next answer starts a new one."""
        self._pools.pop(pool_name(worker), None)

    def held(self, prompt: tuple[int, ...]) -> dict[PoolName, int]:
        """Of `prompt`, the leading tokens each known pool holds; its keys computed once for
        every pool of one block size and first parent (all pools of one model), and only as
        far as a pool holds them."""
        keys: dict[tuple[int, bytes], PromptKeys] = {}
        held = {}
        for name, copy in self._pools.items():
            if not copy.keys or not copy.block_size:
                continue
            kind = (copy.block_size, copy.none_hash)
            prompt_keys = keys.get(kind) or keys.setdefault(kind, PromptKeys(prompt, *kind))
            blocks = 0
            while (key := prompt_keys.key(blocks)) is not None and key in copy.keys:
                blocks += 1
            held[name] = blocks * copy.block_size
        return held

    def view(self) -> list[dict]:
        """Each pool's copy, for /pdserve/workers: its store, change number and blocks, and how
        a prompt's keys are computed for it (block size, first parent in hex)."""
        return [
            {
                "host_id": host_id,
                "kv_pool": kv_pool,
                "store_id": copy.store_id,
                "sequence": copy.sequence,
                "blocks": len(copy.keys),
                "block_size": copy.block_size,
                "first_parent": copy.none_hash.hex(),
            }
            for (host_id, kv_pool), copy in sorted(self._pools.items())
        ]

    def forget_unused(self, workers: list[WorkerHandle]) -> None:
        """Drop the copies of pools no member uses any more."""
        used = {pool_name(worker) for worker in workers if worker.identity.kv_pool}
        for name in [name for name in self._pools if name not in used]:
            del self._pools[name]
