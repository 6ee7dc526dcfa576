"""What admission is told of a request (router/flow/admission.py's `asking`, its priority from the
x-pdserve-priority header or the body) and the workers' side of its forecast wait
(router/flow/wait_forecast.py) from the pool's live state. A fake pool and tokenizer."""

import math

import pytest

from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from router.flow.admission import HttpAsk, admit, asking
from router.flow.wait_forecast import Ask, WaitForecast
from router.http.errors import OpenAIError
from router.http.openai_types import CompletionRequest
from router.workers.pool import WorkerPool
from tests.fakes import FakeTokenizer, answering

SETTINGS = RouterSettings(model="m", request_timeout_s=60)


@pytest.fixture
def pool() -> WorkerPool:
    pool = WorkerPool([])
    pool.workers = [answering("decode-a"), answering("decode-b"), answering("prefill-a", "prefill")]
    return pool


def admitted(pool: WorkerPool, body: dict, priority=None, timeout=None):
    ask = HttpAsk("completions", CompletionRequest, body, "cmpl", 100.0, None, timeout, priority)
    return admit(SETTINGS, pool, FakeTokenizer("m"), ask)


def reported(worker, queued_tokens: int, s_per_token: float = 0.01) -> None:
    worker.load.reported(
        worker_pb2.StatsReply(
            outstanding_prefill_tokens=queued_tokens,
            prefill_seconds_per_token=s_per_token,
            decode_step_base_seconds=0.05,
            decode_step_seconds_per_sequence=0.01,
        )
    )


def test_the_header_sets_the_class_over_the_body_and_a_bad_one_is_a_400(pool):
    body = {"prompt": "abc", "max_tokens": 4, "priority": 3}
    assert admitted(pool, body).priority == 3
    assert admitted(pool, body, priority="-2").priority == -2
    assert admitted(pool, {"prompt": "abc"}).priority == 0
    with pytest.raises(OpenAIError) as caught:
        admitted(pool, body, priority="high")
    assert (caught.value.status, caught.value.param) == (400, "x-pdserve-priority")


def test_a_request_has_a_limit_only_when_max_queue_wait_or_its_own_deadline_sets_one(pool):
    request = admitted(pool, {"prompt": ["ab", "cde"], "max_tokens": 4, "priority": 1})
    ask = asking(request, RouterSettings(model="m", request_timeout_s=60))
    assert ask == Ask(prompt_tokens=5, max_tokens=4, priority=1, give_up_at=math.inf)
    limited = RouterSettings(model="m", request_timeout_s=60, max_queue_wait_s=2)
    assert asking(request, limited).give_up_at == 100.0 + 2  # arrival + the router's limit
    own = admitted(pool, {"prompt": "ab"}, timeout="1.5")  # below --request-timeout
    assert asking(own, RouterSettings(model="m", request_timeout_s=60)).give_up_at == 101.5
    assert asking(own, limited).give_up_at == 101.5  # the tighter of the two


def test_the_backlog_is_the_least_busy_worker_or_the_unreported_prompts_spread(pool):
    decode_a, decode_b, prefill_a = pool.workers
    reported(decode_a, 400)
    reported(decode_b, 900)
    reported(prefill_a, 200, s_per_token=0.02)
    forecast = WaitForecast(pool)
    assert forecast.backlog_s(0) == pytest.approx(200 * 0.02)  # the prefill worker's queue
    cluster = forecast.costs().prefill_s_per_token
    assert cluster == pytest.approx((0.01 + 0.01 + 0.02) / 3)
    # A burst let through before any worker reported it: its tokens over the three workers.
    assert forecast.backlog_s(3000) == pytest.approx(3000 * cluster / 3)
    prefill_a.load.sent(500)  # sent since its report: queued there too
    assert forecast.backlog_s(0) == pytest.approx(400 * 0.01)


def test_a_turn_is_held_for_its_prefill_and_its_expected_output(pool):
    for worker in pool.workers:
        reported(worker, 0)
    forecast = WaitForecast(pool)
    hold_s = forecast.hold_s(Ask(prompt_tokens=100, max_tokens=11), batch=8)
    assert hold_s == pytest.approx(100 * 0.01 + 10 * (0.05 + 0.01 * 8))


def test_with_no_worker_there_is_no_backlog():
    assert WaitForecast(WorkerPool([])).backlog_s(1000) == 0.0
