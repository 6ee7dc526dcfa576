"""Tokenization never holds the router's event loop longer than a small body's admission
(security review H2): a request is admitted, and /tokenize answered, in the tokenizer's
threads, so /health answers at once while a huge prompt is tokenized; only a body of at most
INLINE_BYTES with one prompt is admitted on the loop; a prompt longer in characters than the
context can hold in tokens is a 400 before the tokenizer sees it; and the body limit follows the
workers' context. The assembled app over a fake worker, with the real PromptTokenizer around a
stub tokenizer that takes TOKENIZE_S per call."""

import asyncio
import threading
import time

import httpx
import pytest

from router.app import BODY_BASE_BYTES, MAX_BODY_BYTES, body_limit
from router.flow import tokenization
from router.flow.admission import INLINE_BYTES, admits_inline
from router.http.openai_types import MAX_BATCH_PROMPTS
from tests.fakes import AppWorker, app_with_workers

TOKENIZE_S = 0.5
LONGEST_TOKEN = "<|a special token, 36 characters|>!"


class SlowTokenizer:
    """Stands in for the HF tokenizer: one token per character, after TOKENIZE_S of sleep (which,
    as HF's Rust encoder does, lets go of the GIL)."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = threading.Event()

    def __len__(self) -> int:
        return 0x110000

    def get_vocab(self) -> dict[str, int]:
        return {"a": 97, "b": 98, LONGEST_TOKEN: 1000}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        self.thread = threading.current_thread()
        self.started_at = time.monotonic()
        self.started.set()
        time.sleep(TOKENIZE_S)
        return [ord(c) for c in text]

    def apply_chat_template(self, conversation, **options) -> str:
        return "".join(message["content"] for message in conversation)

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


@pytest.fixture
def app(monkeypatch):
    stub = SlowTokenizer()
    monkeypatch.setattr(tokenization, "load_tokenizer", lambda model: stub)
    app = app_with_workers(monkeypatch, tokenizer=tokenization.PromptTokenizer)
    app.state.stub = stub
    return app


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "ab" * 1000, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * 1000}]}),
        ("/v1/completions", {"prompt": ["ab", "ab"], "max_tokens": 1}),  # small, but a batch
        ("/tokenize", {"prompt": "ab" * 1000}),
    ],
)
def test_health_answers_at_once_while_a_prompt_is_tokenized(app, path, body):
    async def go():
        async with client_of(app) as client:
            tokenizing = asyncio.create_task(client.post(path, json=body))
            while not app.state.stub.started.is_set():
                await asyncio.sleep(0.005)
            health = await client.get("/health")
            # from the tokenizer's start (a loop held by it answers after its end)
            health_s = time.monotonic() - app.state.stub.started_at
            still_tokenizing = not tokenizing.done()
            return health, health_s, still_tokenizing, await tokenizing

    health, health_s, still_tokenizing, served = asyncio.run(go())
    assert health.status_code == 200
    assert health_s < 0.1, f"/health took {health_s:.3f} s while a prompt was tokenized"
    assert still_tokenizing
    assert served.status_code == 200, served.text


def test_a_prompt_too_long_for_the_context_in_characters_is_refused_untokenized(app):
    tokenizer = app.state.tokenizer
    context = app.state.pool.max_model_len  # 4096, the fake worker's
    assert tokenizer.max_token_chars == len(LONGEST_TOKEN)
    too_long = "a" * (context * len(LONGEST_TOKEN) + 1)

    async def go():
        async with client_of(app) as client:
            return [
                await client.post("/v1/completions", json={"prompt": too_long}),
                await client.post("/v1/completions", json={"prompt": [too_long, "ab"]}),
                await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": too_long}]},
                ),
                await client.post("/tokenize", json={"prompt": too_long}),
            ]

    for response in asyncio.run(go()):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] in ("prompt", "messages")
    assert app.state.stub.calls == 0
    assert app.state.pool.workers[0].requests == []


def test_the_body_limit_follows_the_context():
    assert body_limit(0) == MAX_BODY_BYTES  # no worker yet: the ceiling
    assert body_limit(4096) == BODY_BASE_BYTES + MAX_BATCH_PROMPTS * 4096 * 16
    assert body_limit(1 << 20) == MAX_BODY_BYTES


def test_a_body_over_the_contexts_limit_is_a_413(monkeypatch):
    app = app_with_workers(monkeypatch, AppWorker("decode-a"))
    limit = body_limit(4096)
    assert limit < MAX_BODY_BYTES

    async def go():
        async with client_of(app) as client:
            return await client.post(
                "/v1/completions",
                content=b'{"prompt": "' + b"a" * limit + b'"}',
                headers={"content-type": "application/json"},
            )

    response = asyncio.run(go())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_small_body_is_tokenized_on_the_event_loops_thread(app):
    async def go():
        async with client_of(app) as client:
            return await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1})

    assert asyncio.run(go()).status_code == 200
    assert app.state.stub.thread is threading.current_thread()


def test_only_a_small_body_with_one_prompt_is_admitted_on_the_loop():
    text = {"prompt": "ab", "max_tokens": 1}
    assert admits_inline(text, 40)
    assert admits_inline({"prompt": [1, 2, 3]}, 40)  # token ids: one prompt
    assert admits_inline({"messages": [{"role": "user", "content": "ab"}]}, 60)
    assert admits_inline(text, INLINE_BYTES)
    assert not admits_inline(text, INLINE_BYTES + 1)
    assert not admits_inline(text, None)  # a chunked body: its size was not declared
    assert not admits_inline({"prompt": ["a", "b"]}, 40)  # a batch
    assert not admits_inline({"prompt": [[1, 2], [3]]}, 40)
    assert not admits_inline(["not", "an", "object"], 40)
