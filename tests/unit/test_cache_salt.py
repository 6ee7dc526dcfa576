"""Review M8: no prefix-cache oracle across tenants. Each API key salts the prefix caches (its
requests carry a salt derived from the key, vLLM's cache_salt, to the workers, whose engines
hash it into their block hashes), a request's own `cache_salt` salts within its key, and the
router's prefix index (cache-aware routing) is salted the same way. Fake workers and tokenizer;
the worker side with a fake engine that records what it is given."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from pdserve.worker.service import State, WorkerService
from router import app as router_app
from router.http.api_keys import ADMIN_ENV, ENV, OPERATOR_ENV
from router.workers.policies import CacheAware
from router.workers.prefix_index import CHUNK_TOKENS, cache_salt, chunk_hashes
from tests.fakes import FakeTokenizer, answering

PROMPT = "x" * (2 * CHUNK_TOKENS)  # two whole chunks of the fake tokenizer's tokens


def test_salted_chunk_hashes_differ_by_salt_and_unsalted_ones_are_unchanged():
    ids = [ord(c) for c in PROMPT]
    plain = chunk_hashes(ids, "")
    assert chunk_hashes(ids) == plain  # no request salt set
    assert chunk_hashes(ids, "a") != plain and chunk_hashes(ids, "a") != chunk_hashes(ids, "b")
    token = cache_salt.set("a")
    try:
        assert chunk_hashes(ids) == chunk_hashes(ids, "a")
    finally:
        cache_salt.reset(token)


def test_the_cache_aware_index_matches_a_prompt_only_under_its_own_salt():
    policy, worker, ids = CacheAware(), answering("decode-a"), [ord(c) for c in PROMPT]
    token = cache_salt.set("tenant-a")
    try:
        policy.computes(worker, ids)
        assert policy.cached_tokens(worker, ids) == len(ids)
    finally:
        cache_salt.reset(token)
    for other in ("tenant-b", ""):
        token = cache_salt.set(other)
        try:
            assert policy.cached_tokens(worker, ids) == 0
        finally:
            cache_salt.reset(token)


@pytest.fixture
def router(monkeypatch):
    """`router(**settings)`: a TestClient over an app with `settings` and one fake decode worker
    that records the requests it gets."""
    for name in (ENV, OPERATOR_ENV, ADMIN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    opened = []

    def make(**settings):
        app = router_app.create_app(RouterSettings(model="m", **settings), "models/m")
        client = TestClient(app)
        client.__enter__()
        opened.append((client, app))
        worker = answering("decode-a")
        app.state.pool.workers = [worker]  # after the start's wait for workers
        return client, app, worker

    yield make
    for client, app in opened:
        app.state.pool.workers = []  # fakes: nothing to close
        client.__exit__(None, None, None)


def salts(client, worker, *calls) -> list[str]:
    """The cache salt each call (key, body extras) reached the worker with."""
    for key, extra in calls:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        body = {"prompt": PROMPT, "max_tokens": 2, **extra}
        response = client.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
    return [request.cache_salt for request in worker.requests]


def test_two_keys_sending_the_same_prompt_never_share_a_salt(router):
    client, _, worker = router(api_key=["sk-a", "sk-b"], policy="cache-aware")
    a1, a2, b, a_own, b_own = salts(
        client,
        worker,
        ("sk-a", {}),
        ("sk-a", {}),
        ("sk-b", {}),
        ("sk-a", {"cache_salt": "mine"}),
        ("sk-b", {"cache_salt": "mine"}),
    )
    assert a1 == a2 and a1  # one key: one cache
    assert b and b != a1  # another key: another cache
    assert len({a1, b, a_own, b_own}) == 4  # a request's salt partitions its key's cache only
    assert "sk-a" not in a1 and "sk-b" not in b  # a digest, not the key


def test_the_router_index_is_salted_like_the_workers_caches(router):
    client, app, worker = router(api_key=["sk-a", "sk-b"], policy="cache-aware")
    [salt_a] = salts(client, worker, ("sk-a", {}))
    index, ids = app.state.choice.policy.index, [ord(c) for c in PROMPT]
    assert index.cached_tokens(worker.address, chunk_hashes(ids, salt_a)) == len(ids)
    assert index.cached_tokens(worker.address, chunk_hashes(ids, "")) == 0


def test_keys_share_the_cache_only_when_configured_and_an_open_router_is_unsalted(router):
    client, _, worker = router(api_key=["sk-a", "sk-b"], cache_salt_per_key=False)
    assert salts(client, worker, ("sk-a", {}), ("sk-b", {})) == ["", ""]
    client, _, worker = router()
    plain, salted = salts(client, worker, ("", {}), ("", {"cache_salt": "s"}))
    assert plain == "" and salted and salted != "s"


@pytest.mark.parametrize("salt", ["", "a/b", "a@b", "x" * 129])
def test_a_cache_salt_vllm_refuses_is_a_400(router, salt):
    client, _, worker = router()
    body = {"prompt": "ab", "max_tokens": 1, "cache_salt": salt}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
    assert worker.requests == []


class RecordingEngine:
    """Stands in for vLLM's AsyncLLM: records the prompt each request is given; generates
    nothing."""

    def __init__(self) -> None:
        self.prompts = []

    async def generate(
        self, prompt, sampling, request_id, trace_headers=None, data_parallel_rank=None
    ):
        self.prompts.append(prompt)
        return
        yield


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_the_worker_gives_its_engine_the_requests_cache_salt():
    service = WorkerService("decode-a", "decode", "m")
    service.engine, service.state = RecordingEngine(), State.READY
    service.identity.max_model_len = 64
    sampling = worker_pb2.SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0)

    async def run(**fields):
        request = worker_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=sampling, **fields
        )
        async for _ in service.Generate(request, Context()):
            pass

    asyncio.run(run(cache_salt="tenant-a"))
    asyncio.run(run())
    assert service.engine.prompts == [
        {"prompt_token_ids": [1, 2], "cache_salt": "tenant-a"},
        {"prompt_token_ids": [1, 2]},  # unsalted: as before
    ]
