"""Client input the router once answered with a 500 (security review M5,
reproductions/poc_router_500s.py): integers past the worker protocol's int32/uint32 fields,
JSON nested deeper than Python's parser goes, numbers and constants JSON has not, and a
request_id a header cannot carry. Each is a 400 with OpenAI's error body, and no worker is
asked. The assembled app over a fake worker (tests/fakes.py)."""

import pytest
from fastapi.testclient import TestClient

from tests.fakes import app_with_workers

COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_BODIES = {
    "top_k": ("completions", {**COMPLETION, "top_k": 2**31}, "top_k"),
    "min_tokens": ("completions", {**COMPLETION, "min_tokens": 2**32}, "min_tokens"),
    "logprobs": ("completions", {**COMPLETION, "logprobs": 2**31}, "logprobs"),
    "prompt_logprobs": ("completions", {**COMPLETION, "prompt_logprobs": 2**31}, "prompt_logprobs"),
    "top_logprobs": (
        "chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 2**31},
        "top_logprobs",
    ),
    "stop_token_ids": ("completions", {**COMPLETION, "stop_token_ids": [2**31]}, "stop_token_ids"),
    "request_id non-Latin-1": (
        "completions",
        {**COMPLETION, "request_id": "abc-\u4e2d"},
        "request_id",
    ),
    "request_id with a newline": (
        "chat/completions",
        {**CHAT, "request_id": "abc\r\nx-injected: 1"},
        "request_id",
    ),
}

BAD_JSON = {
    "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
    "nested objects": b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "an integer of 5000 digits": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    "NaN": b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
    "Infinity": b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": -Infinity}}',
    # a lone UTF-16 surrogate, escaped or as UTF-8 bytes (json reads both), echoed in the reply
    "a lone surrogate escaped": (
        b'{"messages": [{"role": "assistant", "content": "\\udc00"}], "echo": true,'
        b' "prompt": "\\ud800"}'
    ),
    "a lone surrogate's bytes": '{"messages": [{"role": "user", "content": "\udc00"}], '
    '"prompt": "\ud800", "echo": true}'.encode("utf-8", "surrogatepass"),
}


@pytest.fixture
def served(monkeypatch):
    app = app_with_workers(monkeypatch)
    return TestClient(app), app.state.pool.workers[0]


def assert_openai_400(response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    return error


def test_a_good_request_reaches_the_worker(served):
    """The baseline: the same bodies without the bad field are served."""
    client, worker = served
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    response = client.post("/v1/chat/completions", json={**CHAT, "request_id": "my-id_1.2:3"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "chatcmpl-my-id_1.2:3"
    emoji = {"messages": [{"role": "assistant", "content": "\U0001f600"}], "echo": True}
    response = client.post("/v1/chat/completions", json=emoji)  # an escaped surrogate pair
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"].startswith("\U0001f600")
    assert len(worker.requests) == 3


@pytest.mark.parametrize("case", BAD_BODIES)
def test_an_out_of_range_field_is_a_400_naming_it(served, case):
    client, worker = served
    endpoint, body, param = BAD_BODIES[case]
    error = assert_openai_400(client.post(f"/v1/{endpoint}", json=body))
    assert error["param"].startswith(param)
    assert worker.requests == []


@pytest.mark.parametrize("case", BAD_JSON)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_python_cannot_read_as_json_is_a_400(served, case, path):
    client, worker = served
    headers = {"content-type": "application/json"}
    assert_openai_400(client.post(path, content=BAD_JSON[case], headers=headers))
    assert worker.requests == []
