"""Which worker has computed what: the router's estimate of each worker's prefix cache.

A prompt is cut into chunks of CHUNK_TOKENS tokens; each chunk is named by a hash of every
token up to its end (so a chunk matches only after the same prefix, as vLLM's block hashes
do). A worker's entry holds the chunk hashes of the prompts the router sent it, least recently
used first out, bounded like the cache it estimates. The estimate is the router's own view: it
does not see evictions, so it overestimates an old entry, and the bound keeps that short-lived.
Several routers share what they sent (router/shared/state.py): each one's additions go out
through `outbox` and come in to the others through `learn`.

The engines' prefix caches are salted (vLLM's cache_salt: per API key, and by a request's own
cache_salt, router/http/api_keys.py), so the chunk hashes are too: a prompt matches only the chunks
of prompts of the same salt, as a block matches in the engine. The salt of the request being
served is `cache_salt`, set once it is admitted (router/http/generation.py) for the steps
that follow in its task, which the policies are called from with its token ids alone.
"""

import hashlib
from collections import OrderedDict
from contextvars import ContextVar

CHUNK_TOKENS = 64  # a divisor of vLLM's block sizes (16 on GPU, 128 on CPU): chunk ends align
MAX_CHUNKS_PER_WORKER = 65536  # 4M tokens: more than a CPU worker's KV cache holds
DIGEST_BYTES = 16  # per chunk hash
cache_salt: ContextVar[str] = ContextVar("pdserve_cache_salt", default="")  # the request's


def chunk_hashes(prompt_ids: list[int], salt: str | None = None) -> list[bytes]:
    """One hash per whole chunk of the prompt, each covering all tokens before its end and
    `salt` (default: the request's `cache_salt`; "": unsalted)."""
    salt = cache_salt.get() if salt is None else salt
    hashes, running = [], hashlib.blake2b(digest_size=DIGEST_BYTES)
    if salt:
        running.update(b"cache_salt\0" + salt.encode() + b"\0")
    for end in range(CHUNK_TOKENS, len(prompt_ids) + 1, CHUNK_TOKENS):
        running.update(
            b"".join(t.to_bytes(4, "little") for t in prompt_ids[end - CHUNK_TOKENS : end])
        )
        hashes.append(running.copy().digest())
    return hashes


class PrefixIndex:
    def __init__(self, max_chunks: int = MAX_CHUNKS_PER_WORKER) -> None:
        self.max_chunks = max_chunks
        self._chunks: dict[str, OrderedDict[bytes, None]] = {}  # worker address -> chunks
        self.outbox: list[tuple[str, list[bytes]]] | None = None  # shared: what to publish

    def cached_tokens(self, address: str, hashes: list[bytes]) -> int:
        """Leading prompt tokens the worker likely has in its prefix cache."""
        chunks = self._chunks.get(address)
        matched = 0
        while chunks is not None and matched < len(hashes) and hashes[matched] in chunks:
            matched += 1
        return matched * CHUNK_TOKENS

    def sent(self, address: str, hashes: list[bytes]) -> None:
        """The worker computes (or receives) these chunks now."""
        if self.outbox is not None and hashes:
            self.outbox.append((address, hashes))
        self.learn(address, hashes)

    def learn(self, address: str, hashes: list[bytes]) -> None:
        """The worker has these chunks (another router sent them)."""
        chunks = self._chunks.setdefault(address, OrderedDict())
        for digest in hashes:
            chunks[digest] = None
            chunks.move_to_end(digest)
        while len(chunks) > self.max_chunks:
            chunks.popitem(last=False)

    def forget(self, address: str) -> None:
        """A worker that left (or restarted) has an empty cache."""
        self._chunks.pop(address, None)
