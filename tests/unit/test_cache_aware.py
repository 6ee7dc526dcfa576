"""router/workers/prefix_index.py and the cache-aware policy over fake workers (named fakes: an
address and a load report): prompts that share a prefix go where it is cached, unless that worker is
far busier; prompts that share nothing spread by load."""

from pdserve.protocol import worker_pb2
from router.workers.policies import (
    DECODE_REQUEST_TOKENS,
    POOL_LOAD_SAVES,
    CacheAware,
    pool_load_saves,
)
from router.workers.prefix_index import CHUNK_TOKENS, PrefixIndex, chunk_hashes
from router.workers.prompt_view import PromptView
from tests.fakes import FakeWorker


def prefill_worker(name: str, kv_pool: str = "", host_id: str = "host") -> FakeWorker:
    return FakeWorker(name, "prefill", kv_pool=kv_pool, host_id=host_id)


def view(policy: CacheAware, workers: list[FakeWorker], tokens: list[int], pooled=None):
    """The run's PromptView of `tokens`: what the policy's index says each worker holds, and
    `pooled` (host KV pool -> leading tokens it holds)."""
    return PromptView(tuple(tokens), policy.cached_on_each(workers, tokens), pooled or {})


def prompt(prefix: int, length: int) -> list[int]:
    """`length` tokens: the first 3/4 from prefix family `prefix`, then unique ones."""
    shared = [prefix * 1000 + i for i in range(length * 3 // 4)]
    return shared + [10**6 + prefix * 10**4 + length + i for i in range(length - len(shared))]


def test_a_chunk_matches_only_after_the_same_prefix():
    a = chunk_hashes(list(range(3 * CHUNK_TOKENS)))
    b = chunk_hashes([9] + list(range(1, 3 * CHUNK_TOKENS)))
    assert len(a) == 3 and not set(a) & set(b)
    assert chunk_hashes(list(range(3 * CHUNK_TOKENS + 10)))[:3] == a  # the partial tail: none
    index = PrefixIndex()
    index.sent("w", a[:2])
    assert index.cached_tokens("w", a) == 2 * CHUNK_TOKENS
    assert index.cached_tokens("w", b) == 0 and index.cached_tokens("other", a) == 0


def test_the_index_keeps_the_most_recent_chunks():
    index = PrefixIndex(max_chunks=2)
    first, second = chunk_hashes(list(range(CHUNK_TOKENS))), chunk_hashes([7] * CHUNK_TOKENS)
    index.sent("w", first)
    index.sent("w", second)
    index.sent("w", chunk_hashes([8] * CHUNK_TOKENS))
    assert index.cached_tokens("w", first) == 0 and index.cached_tokens("w", second) == CHUNK_TOKENS


def test_shared_prefixes_stick_to_their_worker_and_families_spread():
    policy, workers = CacheAware(), [prefill_worker("a"), prefill_worker("b")]
    picks = {}
    for request in range(8):
        family = request % 2
        chosen = policy.choose(workers, view(policy, workers, prompt(family, 512 + request)))
        policy.computes(chosen, prompt(family, 512 + request))  # the path took it
        chosen.load.sent(0)  # the router's own count resets with each report; keep it level
        picks.setdefault(family, set()).add(chosen.address)
    assert picks[0] != picks[1] and all(len(seen) == 1 for seen in picks.values())


def test_a_cached_prefix_loses_to_a_long_enough_queue():
    policy, workers = CacheAware(), [prefill_worker("a"), prefill_worker("b")]
    first = policy.choose(workers, view(policy, workers, prompt(0, 1024)))
    policy.computes(first, prompt(0, 1024))
    busy = 2 * 1024 // DECODE_REQUEST_TOKENS
    first.load.reported(worker_pb2.StatsReply(running_requests=busy))
    assert policy.choose(workers, view(policy, workers, prompt(0, 1024))).address != first.address


def test_a_worker_picked_but_not_used_is_not_taken_to_hold_the_prompt():
    """The router picks a prefill worker before the path is priced; when the request then stays
    on its decode worker, the prefill worker never saw the prompt."""
    policy, workers = CacheAware(), [prefill_worker("a"), prefill_worker("b")]
    policy.choose(workers, view(policy, workers, prompt(0, 1024)))
    assert all(
        policy.index.cached_tokens(w.address, chunk_hashes(prompt(0, 1024))) == 0 for w in workers
    )


def test_a_pool_mate_of_a_busy_worker_takes_its_history_and_a_stranger_does_not():
    """a computed the prompt and its host KV pool holds it (what the run's PromptView says); b
    shares that pool, c is on another host whose pool holds none of it. With a moderately
    busy, b can load the history and wins; c would compute it all."""
    policy = CacheAware()
    a, b, c = (
        prefill_worker("a", "@pool"),
        prefill_worker("b", "@pool"),
        prefill_worker("c", "@pool", "other"),
    )
    policy.computes(a, prompt(0, 1024))
    cached = len(chunk_hashes(prompt(0, 1024))) * CHUNK_TOKENS

    pooled = {("host", "@pool"): cached}
    # Busier than the load saves over b's, less busy than the whole prompt's compute.
    busy = int(cached * (1 - POOL_LOAD_SAVES)) // DECODE_REQUEST_TOKENS + 2
    a.load.reported(worker_pb2.StatsReply(running_requests=busy))
    alone = prefill_worker("b")  # in no pool
    seen = view(policy, [a, b, c, alone], prompt(0, 1024), pooled)
    assert policy.choose([a, c], seen) is a
    assert policy.choose([a, b, c], seen) is b
    assert policy.choose([a, alone], seen) is a  # no pool: stays


def test_a_load_saves_what_the_worker_measured_it_saves():
    """pool_load_saves: one less the worker's measured load/compute time ratio per token (its
    Stats), nothing when loading is the slower, the default before it measured both."""
    worker = prefill_worker("a", "@pool")
    assert pool_load_saves(worker) == POOL_LOAD_SAVES
    worker.load.reported(worker_pb2.StatsReply(prefill_seconds_per_token=0.002))
    assert pool_load_saves(worker) == POOL_LOAD_SAVES  # no load measured yet
    worker.load.reported(
        worker_pb2.StatsReply(
            prefill_seconds_per_token=0.002, kv_pool_load_seconds_per_token=0.0005
        )
    )
    assert pool_load_saves(worker) == 0.75
    worker.load.reported(
        worker_pb2.StatsReply(prefill_seconds_per_token=1e-5, kv_pool_load_seconds_per_token=2e-5)
    )
    assert pool_load_saves(worker) == 0.0
