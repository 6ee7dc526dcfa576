"""Review H4 at admission (router/flow/admission.py) and through the app: a request's turn weighs
its engine sequences (prompts × choices), a request no worker or cluster could run at once is a
400, and only operator and admin keys may set a request's priority and path. Fake workers and
tokenizer; the gate is watched, not run, in the app test."""

import dataclasses

import pytest
from fastapi.testclient import TestClient

from pdserve.core.kinds import RoutePath
from pdserve.settings.router import RouterSettings
from router import app as router_app
from router.flow.admission import HttpAsk, admit, sequences
from router.http.api_keys import ADMIN_ENV, ENV, OPERATOR_ENV, Caller, KeyRole
from router.http.errors import OpenAIError, too_many_requests
from router.http.openai_types import CompletionRequest
from router.workers.pool import WorkerPool
from tests.fakes import FakeTokenizer, answering

SETTINGS = RouterSettings(model="m", request_timeout_s=60)
CLIENT, OPERATOR = Caller(KeyRole.CLIENT), Caller(KeyRole.OPERATOR)


def pool_of(max_num_seqs: int = 256, workers: int = 1) -> WorkerPool:
    pool = WorkerPool([])
    pool.workers = [answering(f"decode-{i}") for i in range(workers)]
    for worker in pool.workers:
        worker.identity.max_num_seqs = max_num_seqs
    return pool


def admitted(pool: WorkerPool, body: dict, route=None, priority=None, caller=None):
    ask = HttpAsk("completions", CompletionRequest, body, "cmpl", 100.0, route, None, priority)
    if caller is not None:
        ask = dataclasses.replace(ask, caller=caller)
    return admit(SETTINGS, pool, FakeTokenizer("m"), ask)


def test_a_request_weighs_its_prompts_times_its_choices():
    body = {"prompt": ["ab", "cd", "ef"], "max_tokens": 1, "n": 4, "temperature": 1.0}
    assert sequences(admitted(pool_of(), body)) == 12
    best_of = {"prompt": "ab", "max_tokens": 1, "n": 2, "best_of": 5, "temperature": 1.0}
    assert sequences(admitted(pool_of(), best_of)) == 5


def test_64_prompts_times_n_128_beyond_the_clusters_max_num_seqs_is_a_400():
    body = {"prompt": ["ab"] * 64, "max_tokens": 1, "n": 128, "temperature": 1.0}
    with pytest.raises(OpenAIError) as caught:
        admitted(pool_of(max_num_seqs=256), body)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "n", "invalid_value")
    assert "8192 sequences" in error.message and "256" in error.message
    # what the cluster runs at once is fine: 2 workers of 256
    fits = {"prompt": ["ab"] * 4, "max_tokens": 1, "n": 128, "temperature": 1.0}
    assert sequences(admitted(pool_of(max_num_seqs=256, workers=2), fits)) == 512


def test_more_choices_than_one_worker_runs_at_once_is_a_400():
    body = {"prompt": "ab", "max_tokens": 1, "n": 20, "temperature": 1.0}
    with pytest.raises(OpenAIError) as caught:
        admitted(pool_of(max_num_seqs=16, workers=4), body)
    assert (caught.value.status, caught.value.param) == (400, "n")


def test_priority_and_path_are_ignored_without_an_operator_key():
    body = {"prompt": "ab", "max_tokens": 1, "priority": -5}
    ignored = admitted(pool_of(), body, RoutePath.DISAGGREGATED, "-9", caller=CLIENT)
    assert ignored.priority == 0
    assert all(run.route_forced is None for run in ignored.runs)
    ignored = admitted(pool_of(), body, caller=CLIENT)
    assert ignored.priority == 0  # the body's too
    pool = pool_of()
    pool.workers.append(answering("prefill-a", role="prefill"))
    honoured = admitted(pool, body, RoutePath.DISAGGREGATED, "-9", caller=OPERATOR)
    assert honoured.priority == -9
    assert {run.route_forced.route for run in honoured.runs} == {RoutePath.DISAGGREGATED}
    assert admitted(pool, body, caller=OPERATOR).priority == -5


@pytest.fixture
def watched_app(monkeypatch, tmp_path):
    """An app with a client and an operator key over one fake decode worker; its gate records
    each request's ask and weight, then refuses it (429), so no worker is called."""
    for name in (ENV, OPERATOR_ENV, ADMIN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    operators = tmp_path / "operators"
    operators.write_text("sk-operator\n")
    settings = RouterSettings(
        model="m", worker_addresses=[], api_key=["sk-client"], operator_api_key_file=str(operators)
    )
    app = router_app.create_app(settings, "models/m")
    asked = []

    async def enter(ask, weight=1):
        asked.append((ask.priority, weight))
        raise too_many_requests("watched", 1)

    app.state.gate.enter = enter
    with TestClient(app) as client:
        app.state.pool.workers = [answering("decode-a")]  # after the start's wait for workers
        yield client, asked
        app.state.pool.workers = []  # fakes: nothing to close


def test_through_the_app_a_client_keys_priority_header_is_ignored_and_n_weighs(watched_app):
    client, asked = watched_app
    body = {"prompt": ["ab", "cd"], "max_tokens": 1, "n": 3, "temperature": 1.0}
    for key in ("sk-client", "sk-operator"):
        headers = {"authorization": f"Bearer {key}", "x-pdserve-priority": "-7"}
        assert client.post("/v1/completions", json=body, headers=headers).status_code == 429
    assert asked == [(0, 6), (-7, 6)]
