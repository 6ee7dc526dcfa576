"""Request validation, without a server: each bad body names its problem."""

import json

import pytest

from router.http.errors import OpenAIError
from router.http.openai_types import ChatCompletionRequest, CompletionRequest, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(schema, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_request(schema, body)
    assert caught.value.status == 400
    return caught.value


def test_a_valid_chat_request_keeps_its_fields():
    parsed = parse_request(
        ChatCompletionRequest, {**CHAT, "max_tokens": 5, "stop": "x", "temperature": 0, "seed": 3}
    )
    assert (parsed.max_tokens_asked(), parsed.stop_list(), parsed.temperature, parsed.seed) == (
        5,
        ["x"],
        0.0,
        3,
    )


def test_max_completion_tokens_is_an_alias():
    assert (
        parse_request(
            ChatCompletionRequest, {**CHAT, "max_completion_tokens": 7}
        ).max_tokens_asked()
        == 7
    )


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({**CHAT, "messages": []}, "messages", "invalid_value"),
        ({**CHAT, "messages": "hi"}, "messages", "invalid_value"),
        (
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
            "invalid_value",
        ),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({**CHAT, "max_tokens": -3}, "max_tokens", "invalid_value"),
        ({**CHAT, "max_tokens": "5"}, "max_tokens", "invalid_value"),
        ({**CHAT, "temperature": "hot"}, "temperature", "invalid_value"),
        ({**CHAT, "temperature": 3}, "temperature", "invalid_value"),
        ({**CHAT, "top_p": 0}, "top_p", "invalid_value"),
        ({**CHAT, "stop": ["a"] * 65}, "stop", "invalid_value"),
        ({**CHAT, "stop": "x" * 1025}, "stop", "invalid_value"),
        ({**CHAT, "stop": ["ok", "x" * 1025]}, "stop", "invalid_value"),
        ({**CHAT, "stream": "yes"}, "stream", "invalid_value"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ({**CHAT, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        ({**CHAT, "logprobs": 1}, "logprobs", "invalid_value"),
        ({**CHAT, "logprobs": True, "top_logprobs": -2}, "top_logprobs", "invalid_value"),
        ({**CHAT, "n": 0}, "n", "invalid_value"),
        ({**CHAT, "n": 129}, "n", "invalid_value"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        ({**CHAT, "structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", None),
        ({**CHAT, "priority": 2**63}, "priority", "invalid_value"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param, code):
    error = refused(ChatCompletionRequest, body)
    assert (error.param, error.code) == (param, code or "unrecognized_argument")
    assert param in error.message


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"top_logprobs": 2}, "`logprobs` must be set to true"),
        ({"n": 3, "best_of": 2}, "best_of (2) must be at least n (3)"),
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
        ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
        ({"stream_options": {"include_usage": True}}, "only be defined when `stream=True`"),
        ({"response_format": {"type": "json_schema"}}, "'json_schema' field must be provided"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "only one kind of constraint"),
        ({"logprob_token_ids": [3]}, "`logprobs` must be set"),
    ],
)
def test_rules_across_fields_are_vllms(extra, words):
    error = refused(ChatCompletionRequest, {**CHAT, **extra})
    assert words in error.message
    assert error.code == "invalid_value"


def test_a_field_neither_openai_nor_vllm_knows_is_ignored_with_a_warning(caplog):
    parsed = parse_request(ChatCompletionRequest, {**CHAT, "frobnicate": 1, "tools": []})
    assert parsed.ignored_fields() == ["frobnicate", "tools"]
    assert "ignored: frobnicate, tools" in caplog.text


def test_response_format_becomes_vllms_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "structured_outputs": {"regex": "x+", "disable_any_whitespace": True},
        "logit_bias": {"42": 3.5},
    }
    fields = parse_request(ChatCompletionRequest, body).vllm_fields()
    assert fields["structured_outputs"] == {"json": schema, "disable_any_whitespace": True}
    assert fields["logit_bias"] == {"42": 3.5}
    json_object = {**CHAT, "response_format": {"type": "json_object"}}
    assert parse_request(ChatCompletionRequest, json_object).vllm_fields() == {
        "structured_outputs": {"json_object": True}
    }


def test_echo_asks_prompt_logprobs_as_vllm_does():
    chat = parse_request(
        ChatCompletionRequest, {**CHAT, "echo": True, "logprobs": True, "top_logprobs": 3}
    )
    assert (chat.output_logprobs(), chat.prompt_logprobs_asked()) == (3, 3)
    completion = parse_request(
        CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "logprobs": 2}
    )
    assert (completion.output_logprobs(), completion.prompt_logprobs_asked()) == (2, 2)
    plain = parse_request(CompletionRequest, {"model": "m", "prompt": "x"})
    assert (plain.output_logprobs(), plain.prompt_logprobs_asked()) == (None, None)


def test_a_body_that_is_not_an_object_is_refused():
    assert "JSON object" in refused(ChatCompletionRequest, [1, 2]).message


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("text", ["text"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["text"], ["text"]),
        ([[1, 2]], [[1, 2]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2]], [[1], [2]]),
    ],
)
def test_completion_prompts_in_each_accepted_shape(prompt, prompts):
    assert parse_request(CompletionRequest, {"model": "m", "prompt": prompt}).prompts() == prompts


@pytest.mark.parametrize("prompt", [[], 5, None, "", [-1], ["a"] * 65, [[]]])
def test_completion_prompts_pdserve_refuses(prompt):
    assert refused(CompletionRequest, {"model": "m", "prompt": prompt}).param.startswith("prompt")


def test_suffix_is_named_as_unsupported():
    error = refused(CompletionRequest, {"model": "m", "prompt": "x", "suffix": "y"})
    assert (error.param, error.code) == ("suffix", "unsupported_parameter")


def test_max_tokens_zero_only_with_echo():
    assert (
        "0 only with echo" in refused(CompletionRequest, {"prompt": "x", "max_tokens": 0}).message
    )
    echo = parse_request(CompletionRequest, {"prompt": "x", "max_tokens": 0, "echo": True})
    assert echo.max_tokens == 0


def test_null_means_not_set_for_every_field():
    """What `vllm bench serve` and other clients send: nulls for fields they leave alone."""
    parsed = parse_request(
        CompletionRequest,
        {"model": "m", "prompt": "hi", "logprobs": None, "temperature": None, "stop": None},
    )
    assert (parsed.temperature, parsed.stop_list()) == (1.0, [])


def test_vllm_sampling_extensions_pass_through_by_name():
    body = {
        "model": "m",
        "prompt": "hi",
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "stop_token_ids": [2, 7],
        "skip_special_tokens": False,
        "min_tokens": 3,
        "bad_words": None,
    }
    parsed = parse_request(CompletionRequest, body)
    assert parsed.vllm_fields() == {
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "stop_token_ids": [2, 7],
        "skip_special_tokens": False,
    }
    assert parsed.min_tokens == 3


@pytest.mark.parametrize(
    "field, value",
    [("min_p", 1.5), ("repetition_penalty", 0), ("stop_token_ids", [-1]), ("min_tokens", -1)],
)
def test_vllm_extensions_out_of_vllm_range_are_400s_naming_the_field(field, value):
    with pytest.raises(OpenAIError) as caught:
        parse_request(CompletionRequest, {"model": "m", "prompt": "hi", field: value})
    assert caught.value.status == 400 and caught.value.param.split(".")[0] == field


def nested(depth: int) -> dict:
    """A schema of `depth` objects, each the `items` of the one around it."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


LONG = 65 << 10


@pytest.mark.parametrize(
    "structured, param",
    [
        ({"regex": "a" * LONG}, "structured_outputs.regex"),
        ({"grammar": "root ::= " + "x" * LONG}, "structured_outputs.grammar"),
        ({"structural_tag": "x" * LONG}, "structured_outputs.structural_tag"),
        ({"whitespace_pattern": " " * LONG}, "structured_outputs.whitespace_pattern"),
        ({"json": {"enum": ["x" * 100] * 700}}, "structured_outputs.json"),
        ({"json": nested(65)}, "structured_outputs.json"),
        ({"json": "[" * 5000 + "]" * 5000}, "structured_outputs.json"),
        ({"json": json.dumps(nested(65))}, "structured_outputs.json"),
        ({"choice": ["x" * 1024] * 65}, "structured_outputs"),
        ({"choice": ["x"] * 1025}, "structured_outputs.choice"),
    ],
)
def test_structured_output_constraints_are_bounded(structured, param):
    """Security review L6: constraints the engine compiles are capped at 64 KiB each and a
    JSON schema's nesting at 64 levels."""
    error = refused(ChatCompletionRequest, {**CHAT, "structured_outputs": structured})
    assert error.param == param


def test_response_format_schemas_are_bounded_too():
    schema = {"name": "x", "schema": nested(65)}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": schema}}
    assert refused(ChatCompletionRequest, body).param == "response_format.json_schema.schema"


def test_constraints_within_the_bounds_pass_through():
    within = {"json": nested(64), "disable_any_whitespace": True}
    parsed = parse_request(ChatCompletionRequest, {**CHAT, "structured_outputs": within})
    assert parsed.vllm_fields()["structured_outputs"] == within
    parsed = parse_request(ChatCompletionRequest, {**CHAT, "structured_outputs": {"regex": "a+"}})
    assert parsed.vllm_fields()["structured_outputs"] == {"regex": "a+"}
