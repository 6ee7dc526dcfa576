"""What one /v1/completions response with echo + logprobs costs the router (security review
H3, reproductions/poc_echo_logprobs_memory.py): the echoed prompt's logprobs and its
prompt_logprobs are rendered once per prompt, not once per choice, and a request whose
response would carry more than MAX_RESPONSE_ENTRIES logprob entries is a 400 before any
worker is asked."""

import gc
import tracemalloc

import pytest
from fastapi.testclient import TestClient

from pdserve.protocol import worker_pb2
from router.http.responses import (
    MAX_RESPONSE_ENTRIES,
    Choice,
    CompletionShape,
    OutputOptions,
    Prompt,
    Usage,
)
from tests.fakes import app_with_workers

ECHO_LOGPROBS = OutputOptions(logprobs=20, prompt_logprobs=True, echo=True)


def prompt_of(positions: int) -> Prompt:
    """The reproduction's prompt: 21 entries per position but the first."""
    logprobs = []
    for i in range(positions):
        position = worker_pb2.PositionLogprobs()
        for rank in range(21 if i else 0):
            position.entries.add(
                token_id=1000 + rank if rank else 500 + i % 50,
                logprob=-1.5,
                rank=rank + 1,
                decoded_token=f" t{rank}",
            )
        logprobs.append(position)
    ids = [500 + i % 50 for i in range(positions)]
    return Prompt(token_ids=ids, echo_text="x" * positions * 4, logprobs=logprobs)


def peak_of_whole(prompt: Prompt, n: int) -> int:
    """Peak bytes traced while the whole response body is made."""
    one = prompt.logprobs[1]
    choices = [Choice(i, "a", [7], [one], "length") for i in range(n)]
    shape = CompletionShape("cmpl-1", "m", ECHO_LOGPROBS, str)
    gc.collect()
    tracemalloc.start()
    try:
        body = shape.whole([prompt], [choices], Usage(len(prompt.token_ids), n, 0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(body["choices"]) == n
    assert len(body["choices"][-1]["logprobs"]["tokens"]) == len(prompt.token_ids) + 1
    return peak


def test_n_choices_of_an_echoed_prompt_cost_little_more_than_one():
    prompt = prompt_of(1000)
    one, sixteen = peak_of_whole(prompt, 1), peak_of_whole(prompt, 16)
    assert sixteen < 2 * one, (one, sixteen)


def test_the_reproductions_response_stays_under_a_fixed_bound():
    """2000 positions, n=4: 71 MiB of objects before (once per choice), ~18 MiB now."""
    assert peak_of_whole(prompt_of(2000), 4) < 24 << 20


def test_choices_share_the_rendered_prompt_but_each_keeps_its_own_tokens():
    prompt = prompt_of(3)
    shape = CompletionShape("cmpl-1", "m", ECHO_LOGPROBS, str)
    first, second = (
        shape.whole_choice(prompt, Choice(i, "ab"[i], [7 + i], [prompt.logprobs[1]], "length"))
        for i in range(2)
    )
    assert first["prompt_logprobs"] is second["prompt_logprobs"]
    assert first["text"] == "x" * 12 + "a" and second["text"] == "x" * 12 + "b"
    for name in ("tokens", "top_logprobs"):
        assert first["logprobs"][name][:3] == second["logprobs"][name][:3]
        assert len(first["logprobs"][name]) == 4
    assert first["logprobs"]["text_offset"] == second["logprobs"]["text_offset"]


EXPLOIT = {  # the review's request: about 8k tokens of prompt, echo, logprobs 20, n 128
    "prompt": "y" * 2000,
    "echo": True,
    "logprobs": 20,
    "n": 128,
    "max_tokens": 1,
    "temperature": 1,
}


@pytest.mark.parametrize(
    "body",
    [
        EXPLOIT,
        {"prompt": "y", "logprobs": 20, "n": 128, "max_tokens": 1000},  # output alone
        {"prompt": ["y" * 1000] * 4, "prompt_logprobs": 20, "n": 32, "max_tokens": 1},
    ],
)
def test_a_request_over_the_response_budget_is_a_400_before_any_worker(monkeypatch, body):
    app = app_with_workers(monkeypatch)
    response = TestClient(app).post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("logprobs", "invalid_value")
    assert str(MAX_RESPONSE_ENTRIES) in error["message"]
    assert app.state.pool.workers[0].requests == []


def test_within_the_budget_echo_with_logprobs_is_served(monkeypatch):
    app = app_with_workers(monkeypatch)
    body = {**EXPLOIT, "prompt": "y" * 500, "n": 8}  # 8 x 2 x 500 x 21 = 168k entries
    response = TestClient(app).post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 8
