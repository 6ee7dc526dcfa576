"""The assembled app (router/app.py over router/http/): its routes answer from app.state,
errors keep the OpenAI body, an API key guards all but the open paths, and a request with no
worker joined yet is a 503 counted once. No worker runs: the pool is empty; the tokenizer is a
fake (the real one needs a model folder)."""

import pytest
from fastapi.testclient import TestClient

from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from router import app as router_app
from router.http.errors import invalid_request
from tests.unit.test_request_flow import FakeWorker


class FakeTokenizer:
    """Stands in for router.flow.tokenization.PromptTokenizer: one token per character."""

    vocab_size = 0x110000

    def __init__(self, model: str, max_model_len=None) -> None:
        self.model = model

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def chat_ids(self, messages, *options) -> list[int]:
        return self.text_ids("".join(message.text() for message in messages))

    def chat(self, parsed) -> list[int]:
        return self.chat_ids(parsed.messages)

    def completion_prompts(self, parsed) -> list[list[int]]:
        return [self.text_ids(p) if isinstance(p, str) else p for p in parsed.prompts()]

    def detokenize(self, ids: list[int]) -> str:
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:  # as PromptTokenizer
            raise invalid_request(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return "".join(chr(i) for i in ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def token_text(self, token_id: int) -> str:
        return chr(token_id)


class AppWorker(FakeWorker):
    """A fake worker the assembled app serves from: one token ("h") per choice, with the
    logprobs and prompt logprobs asked for, and stats."""

    def __init__(self, name: str, role: str = "decode", **options) -> None:
        super().__init__(name, role, **options)
        self.max_num_seqs = 256  # room for n=128
        self.flex = False

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float):
        self.requests.append(request)
        sampling = request.sampling
        for index in range(max(sampling.n, 1)):
            chunk = worker_pb2.GenerateChunk(
                index=index,
                token_ids=[104],
                text="h",
                finish_reason="length",
                prompt_tokens=len(request.prompt_token_ids),
            )
            if sampling.HasField("logprobs"):
                chunk.logprobs.append(position(104))
                chunk.cumulative_logprob = -0.5
            if index == 0 and sampling.HasField("prompt_logprobs"):
                prompt = request.prompt_token_ids
                chunk.prompt_logprobs.add()  # the first position has none
                chunk.prompt_logprobs.extend(position(token) for token in prompt[1:])
            yield chunk

    async def stats(self, request, timeout: float = 2.0) -> worker_pb2.StatsReply:
        return worker_pb2.StatsReply()


def position(token_id: int) -> worker_pb2.PositionLogprobs:
    """A position's logprobs: its own token, then a top one."""
    return worker_pb2.PositionLogprobs(
        entries=[
            worker_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, rank=1),
            worker_pb2.TokenLogprob(token_id=32, logprob=-1.5, rank=2),
        ]
    )


def app_with_workers(monkeypatch, *workers: FakeWorker, tokenizer=FakeTokenizer, **settings):
    """The assembled app over `workers` (one AppWorker when none is given), with no lifespan
    (nothing polls them): drive it with TestClient(app) outside a `with`, or httpx's
    ASGITransport. `tokenizer`: the class that stands for PromptTokenizer."""
    monkeypatch.setattr(router_app, "PromptTokenizer", tokenizer)
    app = router_app.create_app(RouterSettings(model="m", worker_addresses=[], **settings), "m")
    app.state.pool.workers = list(workers) or [AppWorker("decode-a")]
    return app


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    app = router_app.create_app(RouterSettings(model="m", worker_addresses=[]), "models/m")
    with TestClient(app) as client:
        yield client


def test_the_info_routes_answer_from_the_apps_state(client):
    assert client.get("/health").status_code == 503  # no worker serves yet
    [card] = client.get("/v1/models").json()["data"]
    assert (card["id"], card["root"]) == ("m", "models/m")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert client.post("/tokenize", json={"prompt": "hi"}).json()["tokens"] == [104, 105]
    assert client.get("/pdserve/workers").json() == {"workers": [], "kv_pools": []}


def test_a_request_before_any_worker_joined_is_a_503_counted_once(client):
    response = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "worker_unavailable"
    metrics = client.get("/metrics").text
    assert 'pdserve_requests_total{endpoint="completions",status="503"} 1.0' in metrics
    assert 'pdserve_errors_total{kind="worker_unavailable"} 1.0' in metrics


def test_errors_keep_the_openai_body(client):
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) >= {"message", "code"}
    too_big = client.post(
        "/v1/completions",
        content=b"x" * (router_app.MAX_BODY_BYTES + 1),
        headers={"content-type": "application/json"},
    )
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"
    bad_roles = client.post("/pdserve/roles", json={"standby": 1})
    assert bad_roles.status_code == 400


def test_an_api_key_guards_every_path_but_the_open_ones(monkeypatch, tmp_path):
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    keys = tmp_path / "keys"
    keys.write_text("the-key\n")
    settings = RouterSettings(model="m", worker_addresses=[], api_key_file=str(keys))
    with TestClient(router_app.create_app(settings, "models/m")) as client:
        assert client.get("/v1/models").status_code == 401
        authorized = {"authorization": "Bearer the-key"}
        assert client.get("/v1/models", headers=authorized).status_code == 200
        assert client.get("/health").status_code == 503  # open: answered, not refused


def test_no_api_docs_and_a_bad_query_parameter_is_an_openai_400(client):
    """Security review L8: no /docs, /redoc or /openapi.json; FastAPI's 422 is a 400 in
    OpenAI's body."""
    for path in ("/docs", "/redoc", "/openapi.json"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["message"]
    bad = client.get("/pdserve/workers", params={"fresh": "sometimes"})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (
        "fresh",
        "invalid_value",
        "invalid_request_error",
    )
