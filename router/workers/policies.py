"""Which worker of a pool takes a request: pluggable policies, chosen with `--policy`.

A policy sees the live candidates (and the request's prompt) and picks one; it never waits.
`least-loaded` compares what the workers themselves report (router/workers/load.py), so that
every router ranks them alike; `cache-aware` adds the prefix each worker likely has cached.
"""

import itertools

from router.workers.handle import WorkerHandle
from router.workers.prefix_index import PrefixIndex, cache_salt, chunk_hashes
from router.workers.prompt_view import NO_PROMPT, PromptView

DECODE_REQUEST_TOKENS = 32  # cache-aware: a running request counts as this much prompt work


class NoCacheIndex:
    """A policy that keeps no index of the workers' prefix caches."""

    def computes(self, worker: WorkerHandle, prompt: list[int]) -> None:
        """Nothing to keep."""

    def cached_tokens(self, worker: WorkerHandle, prompt: list[int]) -> int:
        return 0  # unknown

    def cached_on_each(self, workers: list[WorkerHandle], prompt) -> dict[str, int]:
        return {}  # unknown everywhere

    def cache_lost(self, worker: WorkerHandle) -> None:
        """Nothing to forget."""


class RoundRobin(NoCacheIndex):
    """Takes turns within each pool: one counter per role, so a disaggregated request's two
    picks (prefill, then decode) do not step one shared counter twice, which sent every
    prefill to the same worker of two."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count] = {}

    def choose(self, candidates: list[WorkerHandle], view: PromptView = NO_PROMPT) -> WorkerHandle:
        turn = self._turns.setdefault(candidates[0].role, itertools.count())
        return candidates[next(turn) % len(candidates)]


class LeastLoaded(NoCacheIndex):
    """The idlest by its own report: prompt tokens yet to compute (prefill), requests in the
    engine then KV blocks in use (decode); ties go to the first candidate."""

    name = "least-loaded"

    def choose(self, candidates: list[WorkerHandle], view: PromptView = NO_PROMPT) -> WorkerHandle:
        return min(candidates, key=lambda worker: worker.load.busyness(worker.role))


# Of a prompt token's compute, what loading it from the host KV pool saves, until the worker
# measured both: a load copies its KV (~46 KB a token for SmolLM2 in float32; ~320 KB for a 70B
# model in bfloat16) from host memory and checks its digest, at GB/s, against ~1 ms a token of
# prefill on these CPU workers; on a GPU the margin is smaller, so the estimate stays below 1.
POOL_LOAD_SAVES = 0.9
# ... and what fetching it from another host's pool first saves (pdserve/worker/pool_peers.py):
# the same bytes cross the network once more (~320 KB a token of a 70B model: 26 us at 100 Gb/s,
# near what an 8-GPU engine computes a token in), so the guess is lower.
PEER_FETCH_SAVES = 0.5


def pool_load_saves(worker: WorkerHandle, fetched: bool = False) -> float:
    """Of a prompt token's compute, what loading it from its host KV pool saves `worker` (or,
    `fetched`, fetching it from another host's pool into that one first): one less the ratio
    of its measured load (and fetch) time and compute time per token (all in its Stats), or
    POOL_LOAD_SAVES (PEER_FETCH_SAVES) before it measured them. A load slower than computing
    saves nothing (a small model on a fast GPU can be there)."""
    report = worker.load.report
    if report is None:
        return PEER_FETCH_SAVES if fetched else POOL_LOAD_SAVES
    costs = [report.kv_pool_load_seconds_per_token]
    if fetched:
        costs.append(report.kv_pool_fetch_seconds_per_token)
    if min(report.prefill_seconds_per_token, *costs) <= 0:
        return PEER_FETCH_SAVES if fetched else POOL_LOAD_SAVES
    return max(0.0, 1.0 - sum(costs) / report.prefill_seconds_per_token)


def reusable_tokens(
    own: int,
    loadable: int,
    saves: float = POOL_LOAD_SAVES,
    fetchable: int = 0,
    fetch_saves: float = PEER_FETCH_SAVES,
) -> float:
    """Of a prompt, the tokens a worker need not compute: `own` in its prefix cache, `saves`
    (pool_load_saves) of the further ones its host's KV pool holds (`loadable`), and
    `fetch_saves` of those further still that another host's pool holds (`fetchable`)."""
    pooled = max(own, loadable)
    return own + saves * (pooled - own) + fetch_saves * max(0, fetchable - pooled)


class CacheAware:
    """The worker where the prompt costs least: the prompt tokens it likely has in its prefix
    cache (router/workers/prefix_index.py, from the prompts this router sent it) less the work it
    has queued (prompt tokens yet to compute, running requests at DECODE_REQUEST_TOKENS each), as
    SGLang's and Dynamo's routers weigh them. A worker in a host KV pool can load what the pool
    holds (router/workers/prompt_view.py, as the pool's store reports it), at what
    a load saves it (pool_load_saves), so a busy worker's history no longer holds the conversation
    to it. Ties go to the first candidate."""

    name = "cache-aware"

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self._last: tuple[tuple, list[bytes]] = ((), [])

    def _hashes(self, prompt: list[int]) -> list[bytes]:
        """The prompt's chunk hashes under the request's cache salt, computed once for a
        run's two calls (its prompt view, then `computes`)."""
        salt = cache_salt.get()
        key = (salt, tuple(prompt))
        if key != self._last[0]:
            self._last = (key, chunk_hashes(list(key[1]), salt))
        return self._last[1]

    def choose(self, candidates: list[WorkerHandle], view: PromptView = NO_PROMPT) -> WorkerHandle:
        def gain(worker: WorkerHandle) -> float:
            report = worker.load.report
            queued = worker.load.prompt_tokens_since + worker.load.requests_since * (
                DECODE_REQUEST_TOKENS
            )
            if report is not None:
                queued += report.outstanding_prefill_tokens
                queued += report.running_requests * DECODE_REQUEST_TOKENS
            own, pooled = view.cached_on(worker), view.pooled_for(worker)
            return reusable_tokens(own, pooled, pool_load_saves(worker)) - queued

        return max(candidates, key=gain)

    def computes(self, worker: WorkerHandle, prompt: list[int]) -> None:
        """The worker computes the prompt (or receives its KV) now: its prefix is cached there
        from now on. Told once the request's path is chosen, which may not use every worker
        `choose` picked."""
        self.index.sent(worker.address, self._hashes(prompt))

    def cached_tokens(self, worker: WorkerHandle, prompt: list[int]) -> int:
        """Leading prompt tokens the worker likely has in its prefix cache."""
        return self.index.cached_tokens(worker.address, self._hashes(prompt))

    def cached_on_each(self, workers: list[WorkerHandle], prompt) -> dict[str, int]:
        """cached_tokens of every worker, by address, the prompt hashed once."""
        hashes = self._hashes(prompt)
        return {w.address: self.index.cached_tokens(w.address, hashes) for w in workers}

    def cache_lost(self, worker: WorkerHandle) -> None:
        """The worker lacked what the index said it held (it evicted it): its estimate starts
        again from what it is sent next."""
        self.index.forget(worker.address)


POLICIES = {policy.name: policy for policy in (RoundRobin, LeastLoaded, CacheAware)}
