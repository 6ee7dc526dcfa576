"""The assembled app (router/app.py over router/http/): its routes answer from app.state,
errors keep the OpenAI body, an API key guards all but the open paths, and a request with no
worker joined yet is a 503 counted once. No worker runs: the pool is empty; the tokenizer is a
fake (the real one needs a model folder)."""

import pytest
from fastapi.testclient import TestClient

from pdserve.settings.router import RouterSettings
from router import app as router_app
from tests.fakes import FakeTokenizer


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
