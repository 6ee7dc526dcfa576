"""A prompt's KV pool keys, computed as vLLM's engine computes them, without vLLM: the routers
price a load from each pool with them (router/workers/kv_pool_contents.py), and a worker names the
blocks it fetches from another host's pool (pdserve/worker/pool_peers.py). Plain Python (the router
has no torch, and touches no KV: it only names blocks)."""

import hashlib
import pickle
from collections.abc import Iterator

FIRST_GROUP = (0).to_bytes(4, "big")  # vLLM's make_offload_key: the group index, 4 bytes


def block_keys(prompt: list[int], block_size: int, none_hash: bytes) -> Iterator[bytes]:
    """The keys of the prompt's whole blocks, in order, as vLLM's sha256 block hash
    (vllm.v1.core.kv_cache_utils.hash_block_tokens: each block's hash covers its parent's, the
    first block's parent is `none_hash`; a text prompt has no extra keys) followed by its KV
    cache group (kv_transfer/pool/offload.py stores the engine's one group, 0). Computed as
    they are asked for: a caller stops at the first key a pool lacks."""
    parent = none_hash
    for end in range(block_size, len(prompt) + 1, block_size):
        block = (parent, tuple(prompt[end - block_size : end]), None)
        parent = hashlib.sha256(pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        yield parent + FIRST_GROUP
