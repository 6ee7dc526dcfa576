"""What the host KV pool holds, for the routers (router/workers/kv_pool_contents.py): a worker in a
pool asks its store for the changes after what a router already has, and says how the keys are
computed from a prompt (vLLM's chained sha256 block hash: its block size and first parent), so
the router prices a load from the pool on what the pool holds, not on a guess."""

import logging

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import GetContents
from pdserve.protocol import worker_pb2

log = logging.getLogger("pdserve.worker")


class PoolContentsSource:
    def __init__(self, address: str, block_size: int, none_hash: bytes):
        self.client = PoolClient(address, namespace=None)  # an observer: no memory
        self.block_size = block_size
        self.none_hash = none_hash

    @classmethod
    def of_engine(cls, address: str, vllm_config) -> "PoolContentsSource | None":
        """The source for an engine's pool at `address`; None when the router could not compute
        its keys (a block hash other than vLLM's default, sha256)."""
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

        algorithm = vllm_config.cache_config.prefix_caching_hash_algo
        if algorithm != "sha256":
            log.info("the routers will not see the KV pool's contents: block hash %s", algorithm)
            return None
        none_hash = sha256(resolve_none_hash_seed(sha256))  # vLLM's NONE_HASH
        return cls(address, vllm_config.cache_config.block_size, none_hash)

    def changes(self, store_id: str, since: int) -> worker_pb2.KvPoolContents | None:
        """The store's changes after change `since` of store `store_id` (blocking, within the
        store's call deadline); None when it does not answer."""
        contents = self.client.call(GetContents(store_id, since))
        if contents is None:
            return None
        changes = contents.changes
        return worker_pb2.KvPoolContents(
            store_id=contents.store_id,
            since=since,
            sequence=changes.sequence,
            reset=changes.reset,
            added=changes.added,
            removed=changes.removed,
            block_size=self.block_size,
            none_hash=self.none_hash,
        )
