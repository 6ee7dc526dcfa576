"""Admission (router/flow/admission.py) and the worker request it builds
(router/flow/worker_request.py): one run per prompt of a batch, under one deadline, the
x-pdserve-route header on every run, and the 400s a request gets before any worker sees it. A fake
pool and tokenizer."""

import pytest

from pdserve.core.kinds import RoutePath, RouteReason
from pdserve.settings.router import RouterSettings
from router.flow.admission import HttpAsk, admit
from router.flow.route_choice import ROUTE_HEADER
from router.http.errors import OpenAIError
from router.http.openai_types import CompletionRequest
from router.workers.pool import WorkerPool
from tests.fakes import FakeTokenizer, answering

SETTINGS = RouterSettings(model="m", request_timeout_s=60)


@pytest.fixture
def pool() -> WorkerPool:
    pool = WorkerPool([])
    pool.workers = [answering("decode-a"), answering("prefill-a", role="prefill")]
    return pool


def admitted(pool: WorkerPool, body: dict, route=None, timeout=None):
    ask = HttpAsk("completions", CompletionRequest, body, "cmpl", 100.0, route, timeout)
    return admit(SETTINGS, pool, FakeTokenizer("m"), ask)


def test_a_batch_is_one_run_per_prompt_each_forced_onto_the_asked_path(pool):
    request = admitted(pool, {"prompt": ["ab", "cde"], "max_tokens": 2}, "disaggregated", "5")
    assert [run.prompt_tokens for run in request.runs] == [2, 3]
    ids = [run.request_id for run in request.runs]
    assert ids == [f"{request.request_id}-0", f"{request.request_id}-1"]
    assert [list(w.prompt_token_ids) for w in request.worker_requests] == [[97, 98], [99, 100, 101]]
    assert [w.request_id for w in request.worker_requests] == ids
    assert all(w.sampling.max_tokens == 2 for w in request.worker_requests)
    assert {(run.route_forced.route, run.route_forced.reason) for run in request.runs} == {
        (RoutePath.DISAGGREGATED, RouteReason.HEADER)
    }
    assert {(run.arrival, run.timeout_s) for run in request.runs} == {(100.0, 5.0)}  # the client's


def test_a_reused_client_request_id_still_gives_the_workers_unique_ids(pool):
    body = {"prompt": "ab", "max_tokens": 1, "request_id": "mine"}
    first, second = admitted(pool, body), admitted(pool, body)
    assert first.request_id == second.request_id == "cmpl-mine"
    assert first.runs[0].request_id != second.runs[0].request_id


def test_a_prompt_beyond_the_context_is_a_400_naming_the_prompt(pool):
    with pytest.raises(OpenAIError) as caught:
        admitted(pool, {"prompt": "x" * 4096, "max_tokens": 1})
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert caught.value.code == "context_length_exceeded"


def test_an_unknown_route_header_is_a_400(pool):
    with pytest.raises(OpenAIError) as caught:
        admitted(pool, {"prompt": "ab", "max_tokens": 1}, route="sideways")
    assert (caught.value.status, caught.value.param) == (400, ROUTE_HEADER)
