"""Request validation, without a server: each bad body names its problem."""

import pytest

from router.errors import OpenAIError
from router.openai_types import ChatCompletionRequest, CompletionRequest, parse_request

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
        ({"messages": CHAT["messages"]}, "model", "missing_required_parameter"),
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
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({**CHAT, "stop": "x" * 1025}, "stop", "invalid_value"),
        ({**CHAT, "stop": ["ok", "x" * 1025]}, "stop", "invalid_value"),
        ({**CHAT, "stream": "yes"}, "stream", "invalid_value"),
        ({**CHAT, "frobnicate": 1}, "frobnicate", "unrecognized_argument"),
        ({**CHAT, "tools": []}, "tools", "unsupported_parameter"),
        ({**CHAT, "logprobs": True}, "logprobs", "unsupported_parameter"),
        ({**CHAT, "n": 2}, "n", "unsupported_parameter"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param, code):
    error = refused(ChatCompletionRequest, body)
    assert (error.param, error.code) == (param, code)
    assert param in error.message


def test_a_body_that_is_not_an_object_is_refused():
    assert "JSON object" in refused(ChatCompletionRequest, [1, 2]).message


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["text"], [[1, 2]]])
def test_completion_prompts_in_each_accepted_shape(prompt):
    assert parse_request(CompletionRequest, {"model": "m", "prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("prompt", [["a", "b"], [], 5, None, [[1], [2]]])
def test_completion_prompts_pdserve_refuses(prompt):
    assert refused(CompletionRequest, {"model": "m", "prompt": prompt}).param.startswith("prompt")


def test_echo_and_suffix_are_named_as_unsupported():
    assert refused(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}).code == (
        "unsupported_parameter"
    )


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
