"""The router's answers equal `vllm serve`'s own for the same request on the same model, for
every OpenAI and vLLM feature the issue lists (logprobs, prompt logprobs, echo, n, best_of,
batches, stop reasons, logit_bias, allowed tokens, structured outputs), streamed and whole, on
the local and on the disaggregated path.

The reference is vLLM's own OpenAI server (the `vllm_server` fixture) with the workers' engine
settings; the comparison (tests/integration/vllm_parity.py) is exact but for logprobs (1e-4).
"""

import functools
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from pdserve.core.kinds import RoutePath
from router.flow.route_choice import ROUTE_HEADER
from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP
from tests.integration.prompts import CHATS, PROMPTS
from tests.integration.vllm_parity import ask, assert_same

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
SEEDED = {"temperature": 0.8, "seed": 5}
# (name, endpoint, body without model, streamable). Bodies asking token ids by text use
# {"token": text}, resolved with the model's tokenizer.
CASES = [
    (
        "logprobs-echo",
        "completions",
        {"prompt": PROMPTS[0], "max_tokens": 6, "logprobs": 2, "echo": True},
        True,
    ),
    (
        "prompt-logprobs",
        "completions",
        {"prompt": PROMPTS[2], "max_tokens": 4, "prompt_logprobs": 3},
        False,
    ),
    (
        "echo-alone",
        "completions",
        {"prompt": PROMPTS[1], "max_tokens": 0, "echo": True, "logprobs": 1},
        True,
    ),
    (
        "batch-n",
        "completions",
        {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 5, "logprobs": 1, **SEEDED},
        True,
    ),
    (
        "token-prompt-batch",
        "completions",
        {"prompt": [[504, 3575, 282], [1350]], "max_tokens": 4},
        True,
    ),
    (
        "stop-string",
        "completions",
        {"prompt": PROMPTS[0], "max_tokens": 16, "stop": [".", "!"]},
        True,
    ),
    (
        "stop-token",
        "completions",
        {"prompt": PROMPTS[0], "max_tokens": 16, "stop_token_ids": [{"token": "."}]},
        True,
    ),
    (
        "logit-bias",
        "completions",
        {"prompt": PROMPTS[3], "max_tokens": 4, "logit_bias": {"token": " blue", "bias": 100}},
        True,
    ),
    (
        "allowed-tokens",
        "completions",
        {
            "prompt": PROMPTS[3],
            "max_tokens": 3,
            "allowed_token_ids": [{"token": " red"}, {"token": ","}],
            "logprobs": 0,
        },
        True,
    ),
    (
        "choice",
        "completions",
        {
            "prompt": "Is Paris in France? Answer:",
            "max_tokens": 5,
            "structured_outputs": {"choice": [" yes", " no"]},
        },
        True,
    ),
    (
        "regex",
        "completions",
        {"prompt": "The year was", "max_tokens": 8, "structured_outputs": {"regex": " [0-9]{4}"}},
        True,
    ),
    (
        "token-ids-as-text",
        "completions",
        {"prompt": PROMPTS[1], "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True},
        True,
    ),
    (
        "chat-logprobs",
        "chat/completions",
        {"messages": CHATS[0], "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
        True,
    ),
    (
        "chat-n",
        "chat/completions",
        {"messages": CHATS[1], "max_tokens": 6, "n": 3, "logprobs": True, **SEEDED},
        True,
    ),
    (
        "chat-json-schema",
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "What is 2 + 2? Reply in JSON."}],
            "max_tokens": 24,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
            },
        },
        True,
    ),
    (
        "chat-echo",
        "chat/completions",
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello"},
            ],
            "max_tokens": 5,
            "echo": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        True,
    ),
]
ROUTES = (RoutePath.LOCAL, RoutePath.DISAGGREGATED)
REFERENCE_CONCURRENCY = 8  # vLLM's answers asked at once


@functools.cache
def token_id(tokenizer, text: str) -> int:
    (only,) = tokenizer.encode(text, add_special_tokens=False)
    return only


def resolved(tokenizer, value):
    """The body with {"token": text} replaced by the token's id (logit_bias: by {id: bias})."""
    if isinstance(value, dict) and "token" in value:
        if "bias" in value:
            return {str(token_id(tokenizer, value["token"])): value["bias"]}
        return token_id(tokenizer, value["token"])
    if isinstance(value, dict):
        return {key: resolved(tokenizer, item) for key, item in value.items()}
    if isinstance(value, list):
        return [resolved(tokenizer, item) for item in value]
    return value


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def references(vllm_server, tokenizer) -> dict:
    """(case, stream) -> vLLM's reduced answer, every one asked at once (vLLM batches them: one
    at a time they took a minute; answers computed in other batches are what the comparison
    allows for anyway, as the disaggregated path's are)."""
    keys = [
        (name, stream)
        for name, _, _, streamable in CASES
        for stream in ((False, True) if streamable else (False,))
    ]
    requests = [body_of(tokenizer, *key) for key in keys]  # the tokenizer on this thread only
    with ThreadPoolExecutor(REFERENCE_CONCURRENCY) as pool:
        answers = pool.map(lambda request: ask(vllm_server, *request), requests)
        return dict(zip(keys, answers, strict=True))


def body_of(tokenizer, case: str, stream: bool) -> tuple[str, dict]:
    (endpoint, body) = next((e, b) for name, e, b, _ in CASES if name == case)
    body = {"model": SERVED_MODEL, "temperature": 0.0, **resolved(tokenizer, body)}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return endpoint, body


def params() -> list:
    return [
        pytest.param(name, stream, route, id=f"{name}-{'stream' if stream else 'whole'}-{route}")
        for name, _, _, streamable in CASES
        for stream in ((False, True) if streamable else (False,))
        for route in ROUTES
    ]


@pytest.mark.parametrize("case, stream, route", params())
def test_the_router_answers_as_vllm_serve(server, references, tokenizer, case, stream, route):
    endpoint, body = body_of(tokenizer, case, stream)
    ours = ask(server.url, endpoint, body, {ROUTE_HEADER: route})
    assert_same(ours, references[case, stream])
    assert ours["choices"], "no choice came back"


def test_structured_output_parses_and_validates_against_its_schema(server):
    """Through the openai SDK, on the disaggregated path: the grammar applies from the decode
    worker's first token."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": "What is 2 + 2? Reply in JSON."}],
        max_tokens=24,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        },
        extra_headers={ROUTE_HEADER: RoutePath.DISAGGREGATED},
    )
    import json

    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER_SCHEMA)


def test_the_sdk_gets_logprobs_echo_and_n(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    completion = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    [choice] = completion.choices
    assert choice.text.startswith(PROMPTS[0])
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has none
    assert len(choice.logprobs.tokens) == completion.usage.prompt_tokens + 3
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=CHATS[0],
        max_tokens=4,
        temperature=0.7,
        logprobs=True,
        top_logprobs=3,
        n=2,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(token.top_logprobs) == 3 for token in choice.logprobs.content)
    assert chat.usage.completion_tokens == 8


def test_best_of_returns_the_choice_with_the_highest_cumulative_logprob(server, vllm_server):
    """vLLM's server has no best_of; its n seeded choices (seed + i each, as pdserve samples
    them) with their logprobs say which one best_of must return."""
    body = {"model": SERVED_MODEL, "prompt": PROMPTS[2], "max_tokens": 6, "seed": 9}
    body["temperature"] = 1.0
    candidates = ask(vllm_server, "completions", {**body, "n": 3, "logprobs": 0})["choices"]
    best = max(candidates.values(), key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    for route in ROUTES:
        ours = ask(server.url, "completions", {**body, "n": 1, "best_of": 3}, {ROUTE_HEADER: route})
        assert [c["text"] for c in ours["choices"].values()] == [best["text"]]
        assert ours["choices"][0]["logprobs"] is None  # not asked: not shown
        assert ours["usage"][1] == sum(len(c["logprobs"]["tokens"]) for c in candidates.values())


@pytest.mark.parametrize(
    "endpoint, extra, words",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "logprobs"),
        (
            "chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "invalid type",
        ),
        ("completions", {"structured_outputs": {"regex": "("}}, "regex"),
        ("completions", {"n": 4, "max_tokens": 100_000, "temperature": 1.0}, "context"),
        ("completions", {"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ],
)
def test_requests_vllm_refuses_are_400s_and_the_router_keeps_serving(
    server, endpoint, extra, words
):
    body = {"model": SERVED_MODEL, "max_tokens": 3}
    body.update({"prompt": PROMPTS[0]} if endpoint == "completions" else {"messages": CHATS[0]})
    body.update(extra)
    for route in ROUTES:
        refused = HTTP.post(
            f"{server.base_url}/{endpoint}", json=body, headers={ROUTE_HEADER: route}, timeout=60
        )
        assert refused.status_code == 400, refused.text
        assert words in refused.json()["error"]["message"].lower()
    after = HTTP.post(
        f"{server.base_url}/completions",
        json={"model": SERVED_MODEL, "prompt": PROMPTS[0], "max_tokens": 2},
        timeout=60,
    )
    assert after.status_code == 200
