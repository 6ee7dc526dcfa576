"""Bad input against the real router: an OpenAI-style error body, a 4xx status, never a 5xx,
and the server keeps serving afterwards."""

import pytest

from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP

CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": SERVED_MODEL, "prompt": "hi", "max_tokens": 2}

BAD_REQUESTS = [
    # (endpoint, raw body, status, error code)
    ("chat/completions", b"{not json", 400, None),
    ("chat/completions", b"", 400, None),
    ("chat/completions", b'"a string"', 400, None),
    ("chat/completions", {"model": SERVED_MODEL}, 400, "missing_required_parameter"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "invalid_value"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user"}]},
        400,
        "missing_required_parameter",
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_value",
    ),
    ("chat/completions", {**CHAT, "max_tokens": 0}, 400, "invalid_value"),
    ("chat/completions", {**CHAT, "max_tokens": -1}, 400, "invalid_value"),
    ("chat/completions", {**CHAT, "temperature": "warm"}, 400, "invalid_value"),
    ("chat/completions", {**CHAT, "max_tokens": 100_000}, 400, "context_length_exceeded"),
    ("chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model_not_found"),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
    ("chat/completions", {**CHAT, "n": 3, "temperature": 0}, 400, "invalid_value"),
    ("chat/completions", {**CHAT, "logprobs": 2}, 400, "invalid_value"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, None),
    ("completions", {**COMPLETION, "prompt": [10**9]}, 400, None),
    ("completions", {**COMPLETION, "prompt": "word " * 9000}, 400, "context_length_exceeded"),
    ("completions", {**COMPLETION, "logprobs": -2}, 400, "invalid_value"),
    ("completions", {**COMPLETION, "suffix": "!"}, 400, "unsupported_parameter"),
    ("completions", {**COMPLETION, "model": "nope"}, 404, "model_not_found"),
    # security review M5: inputs that were 500s
    ("completions", {**COMPLETION, "top_k": 2**31}, 400, "invalid_value"),
    ("completions", {**COMPLETION, "min_tokens": 2**32}, 400, "invalid_value"),
    ("completions", {**COMPLETION, "logprobs": 2**31}, 400, "invalid_value"),
    ("completions", {**COMPLETION, "prompt_logprobs": 2**31}, 400, "invalid_value"),
    ("chat/completions", {**CHAT, "request_id": "id-\u4e2d"}, 400, "invalid_value"),
    ("chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    (
        "chat/completions",
        b'{"messages": [{"role": "assistant", "content": "\\udc00"}], "echo": true}',
        400,
        None,
    ),
    # security review H3: a response over the logprob budget, refused before any worker
    (
        "completions",
        {**COMPLETION, "prompt": "word " * 1000, "echo": True, "logprobs": 20, "n": 100},
        400,
        None,
    ),
    # security review L6: a structured-output constraint over 64 KiB
    ("chat/completions", {**CHAT, "structured_outputs": {"regex": "a" * 70_000}}, 400, None),
]


@pytest.mark.parametrize("endpoint, body, status, code", BAD_REQUESTS)
def test_bad_input_gets_an_openai_error(server, endpoint, body, status, code):
    content = body if isinstance(body, bytes) else None
    response = HTTP.post(
        f"{server.base_url}/{endpoint}",
        content=content,
        json=None if content is not None else body,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code or code is None


def test_a_field_neither_openai_nor_vllm_knows_is_ignored_as_vllm_does(server):
    response = HTTP.post(
        f"{server.base_url}/chat/completions", json={**CHAT, "bogus": 1}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_body_beyond_the_limit_is_a_413_without_reading_it_whole(server):
    from router.app import MAX_BODY_BYTES

    huge = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    response = HTTP.post(
        f"{server.base_url}/completions",
        content=huge,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"

    def chunked():  # no content-length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES >> 20):
            yield b"x" * (1 << 20)
        yield b'"}'

    response = HTTP.post(
        f"{server.base_url}/completions",
        content=chunked(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413, response.text


def test_the_server_still_serves_after_bad_input(server):
    for endpoint, body, _, _ in BAD_REQUESTS:
        if isinstance(body, dict):
            HTTP.post(f"{server.base_url}/{endpoint}", json=body, timeout=30)
    response = HTTP.post(f"{server.base_url}/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_prompt_longer_in_characters_than_the_context_holds_is_refused_untokenized(server):
    """Security review H2: refused by its length before the router tokenizes it (megabytes of
    text would hold a tokenizer thread for seconds)."""
    context = HTTP.get(f"{server.base_url}/models", timeout=10).json()["data"][0]["max_model_len"]
    prompt = "a" * (context * 100)  # no token of SmolLM2's vocabulary is 100 characters long
    response = HTTP.post(
        f"{server.base_url}/completions", json={**COMPLETION, "prompt": prompt}, timeout=30
    )
    assert response.status_code in (400, 413), response.text
    assert response.json()["error"]["code"] in ("context_length_exceeded", "request_too_large")


def test_unknown_routes_get_an_openai_error(server):
    response = HTTP.get(f"{server.base_url}/nothing-here", timeout=10)
    assert response.status_code == 404 and "error" in response.json()


def test_errors_are_counted_in_metrics(server):
    HTTP.post(f"{server.base_url}/chat/completions", json={**CHAT, "model": "x"}, timeout=10)
    metrics = HTTP.get(f"{server.url}/metrics", timeout=10).text
    assert 'pdserve_errors_total{kind="model_not_found"}' in metrics
    assert 'pdserve_requests_total{endpoint="chat",status="404"}' in metrics
