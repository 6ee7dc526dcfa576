"""What a client key no longer learns of the cluster's internals (security review M7): which
workers are up (/health), which served a request (x-pdserve-worker headers), the timing
breakdown, and the metrics (whose labels name workers) when they are not public. An operator
or admin key sees them all; an open router (no key) is everyone's, as before."""

import pytest
from fastapi.testclient import TestClient

from pdserve.settings.router import RouterSettings
from router import app as router_app
from router.http.api_keys import ADMIN_ENV, ENV, OPERATOR_ENV
from tests.fakes import FakeTokenizer, answering

CLIENT = {"authorization": "Bearer sk-client"}
OPERATOR = {"authorization": "Bearer sk-operator"}
ADMIN = {"authorization": "Bearer sk-admin"}
BODY = {"prompt": "ab", "max_tokens": 2}


def app_over_one_worker(monkeypatch, **settings):
    for name in (ENV, OPERATOR_ENV, ADMIN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    return router_app.create_app(
        RouterSettings(model="m", worker_addresses=[], **settings), "models/m"
    )


@pytest.fixture
def http(monkeypatch, tmp_path):
    for role in ("operator", "admin"):
        (tmp_path / role).write_text(f"sk-{role}\n")
    app = app_over_one_worker(
        monkeypatch,
        api_key=["sk-client"],
        public_metrics=False,
        operator_api_key_file=str(tmp_path / "operator"),
        admin_api_key_file=str(tmp_path / "admin"),
    )
    with TestClient(app) as client:
        app.state.pool.workers = [answering("decode-a")]  # after the start's wait for workers
        yield client
        app.state.pool.workers = []  # fakes: nothing to close


def test_health_names_the_workers_to_an_admin_key_only(http):
    for headers in ({}, CLIENT, OPERATOR):
        report = http.get("/health", headers=headers).json()
        assert set(report) == {"status", "pools"} and report["pools"]["decode"] == 1
    assert http.get("/health", headers=ADMIN).json()["workers"] == ["decode-a"]


def test_a_client_key_is_not_told_which_worker_served_it_nor_the_timing(http):
    asked = {"x-pdserve-timing": "1"}
    client = http.post("/v1/completions", json=BODY, headers={**CLIENT, **asked})
    assert client.status_code == 200 and client.json()["choices"][0]["text"]
    assert "x-pdserve-worker" not in client.headers
    assert "pdserve_timing" not in client.json()
    operator = http.post("/v1/completions", json=BODY, headers={**OPERATOR, **asked})
    assert operator.headers["x-pdserve-worker"] == "decode-a"
    assert "pdserve_timing" in operator.json()
    streamed = http.post("/v1/completions", json={**BODY, "stream": True}, headers=CLIENT)
    assert streamed.status_code == 200 and "x-pdserve-worker" not in streamed.headers


def test_metrics_that_are_not_public_need_an_operator_key(http):
    assert http.get("/metrics").status_code == 401
    assert http.get("/metrics", headers=CLIENT).status_code == 403
    assert http.get("/metrics", headers=OPERATOR).status_code == 200


def test_an_open_router_tells_everyone_as_before(monkeypatch):
    app = app_over_one_worker(monkeypatch)
    with TestClient(app) as http:
        app.state.pool.workers = [answering("decode-a")]
        try:
            assert http.get("/health").json()["workers"] == ["decode-a"]
            served = http.post("/v1/completions", json=BODY)
            assert served.headers["x-pdserve-worker"] == "decode-a"
        finally:
            app.state.pool.workers = []
