"""router/workers/kv_pool_contents.py: the router computes a prompt's KV pool keys as vLLM computes
its block hashes (checked against vLLM's own request block hasher and offload keys), keeps each
pool's copy up to date from its workers' answers (changes, resets, answers overtaken by a
pool-mate's), and prices a worker's load from its own pool only (fake workers, named fakes: an
address, a host and a pool)."""

import pytest

from pdserve.core.pool_keys import block_keys
from pdserve.protocol import worker_pb2
from router.workers.kv_pool_contents import PoolContents
from router.workers.prompt_view import PromptView
from tests.fakes import FakeWorker

BLOCK = 16
PROMPT = list(range(500, 500 + 5 * BLOCK + 7))  # 5 whole blocks and a partial one


def pool_worker(name: str, kv_pool: str = "@pool", host_id: str = "host-1") -> FakeWorker:
    return FakeWorker(name, kv_pool=kv_pool, host_id=host_id)


def loadable(pools: PoolContents, worker: FakeWorker) -> int:
    """Of PROMPT, the leading tokens `worker`'s pool holds, as a run's PromptView sees it."""
    return PromptView(tuple(PROMPT), pooled=pools.held(tuple(PROMPT))).pooled_for(worker)


@pytest.fixture(scope="module")
def none_hash() -> bytes:
    # vLLM is imported where a test runs, not where every test process collects this file
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash, resolve_none_hash_seed

    init_none_hash(sha256)
    return sha256(resolve_none_hash_seed(sha256))


def vllm_keys(prompt: list[int]) -> list[bytes]:
    """The offload keys vLLM's OffloadingConnector stores a request's blocks under."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    request = Request(
        "r",
        prompt,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    return [make_offload_key(block_hash, 0) for block_hash in request.block_hashes]


def test_the_routers_keys_are_vllms_offload_keys(none_hash):
    keys = list(block_keys(PROMPT, BLOCK, none_hash))
    assert len(keys) == 5 and keys == vllm_keys(PROMPT)
    other = list(block_keys([7, *PROMPT[1:]], BLOCK, none_hash))
    assert all(a != b for a, b in zip(keys, other, strict=True))  # chained: one token changes all


def contents(keys, sequence: int, since: int = 0, reset: bool = False, removed=(), none_hash=b""):
    return worker_pb2.KvPoolContents(
        store_id="store-1",
        since=since,
        sequence=sequence,
        reset=reset,
        added=list(keys),
        removed=list(removed),
        block_size=BLOCK,
        none_hash=none_hash,
    )


def test_a_pool_is_priced_on_what_its_store_reported_up_to_the_first_missing_block(none_hash):
    pools, worker, mate = PoolContents(), pool_worker("a"), pool_worker("b")
    keys = list(block_keys(PROMPT, BLOCK, none_hash))
    assert loadable(pools, worker) == 0  # nothing known yet
    request = pools.stats_request(worker)
    assert request.kv_pool_contents and (request.kv_pool_store_id, request.kv_pool_since) == ("", 0)
    pools.update(worker, contents(keys[:2] + keys[3:], 4, reset=True, none_hash=none_hash))
    assert loadable(pools, worker) == 2 * BLOCK
    assert loadable(pools, mate) == 2 * BLOCK  # same host and pool: same copy
    assert pools.stats_request(mate).kv_pool_since == 4
    pools.update(mate, contents([keys[2]], 5, since=4, removed=[keys[0]], none_hash=none_hash))
    assert loadable(pools, worker) == 0  # the first block was evicted
    pools.update(worker, contents([keys[0]], 6, since=4, none_hash=none_hash))  # overtaken
    assert loadable(pools, worker) == 0
    pools.update(worker, contents([keys[0]], 6, since=5, none_hash=none_hash))
    assert loadable(pools, worker) == 5 * BLOCK
    pools.lost(mate)  # its store did not answer
    assert loadable(pools, worker) == 0
    assert pools.stats_request(worker).kv_pool_store_id == ""  # the next answer: a reset


def test_another_hosts_pool_and_a_worker_without_one_load_nothing(none_hash):
    pools = PoolContents()
    keys = list(block_keys(PROMPT, BLOCK, none_hash))
    pools.update(pool_worker("a"), contents(keys, 5, reset=True, none_hash=none_hash))
    assert loadable(pools, pool_worker("c", host_id="host-2")) == 0
    assert loadable(pools, pool_worker("d", kv_pool="")) == 0
    assert not pools.stats_request(pool_worker("d", kv_pool="")).kv_pool_contents
    pools.forget_unused([pool_worker("c", host_id="host-2")])
    assert loadable(pools, pool_worker("a")) == 0
