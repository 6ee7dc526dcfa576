"""The OpenAI request bodies pdserve accepts, validated strictly.

Unknown fields are refused (as OpenAI does), known OpenAI fields that pdserve does not implement
get a message that says so, and wrong types are never coerced ("5" is not an int).
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.errors import OpenAIError, invalid_request, unsupported_parameter

# OpenAI parameters that exist but pdserve does not implement (yet): refused by name.
UNSUPPORTED = frozenset(
    {
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "best_of",
        "echo",
        "suffix",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "service_tier",
        "store",
        "metadata",
        "web_search_options",
    }
)


# vLLM SamplingParams fields the router passes to the workers untouched (by vLLM's names): a
# new one is a field on SamplingFields and a name here.
VLLM_PASS_THROUGH = (
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "bad_words",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
MAX_STOP_CHARS = 1024  # each stop string is searched for in the text after every token
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    ignore_eos: bool = False  # vLLM's extension, used by benchmarks
    # vLLM's sampling extensions, with vLLM's ranges; unset (or null): vLLM's default.
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2**31)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=64)] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def vllm_fields(self) -> dict:
        """The VLLM_PASS_THROUGH fields the request set: vLLM applies them as they are."""
        return {
            name: getattr(self, name)
            for name in VLLM_PASS_THROUGH
            if getattr(self, name) is not None
        }

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    # One prompt: text, or token ids; a list of one of either is accepted too.
    prompt: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    )

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens


class TokenizeCompletionRequest(StrictModel):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    """vLLM's /tokenize with messages (the chat template applied, as /v1/chat/completions)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def parse_request(model: type[StrictModel], body: object) -> StrictModel:
    """Validate a decoded JSON body, or raise an OpenAIError that names the bad field."""
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    body = {key: value for key, value in body.items() if value is not None}  # null: not set
    unsupported = sorted(UNSUPPORTED & body.keys())
    if unsupported:
        raise unsupported_parameter(unsupported[0])
    if isinstance(body.get("n"), int) and body["n"] != 1:
        raise unsupported_parameter("n", "must be 1: pdserve returns one choice per request")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _first_error(error) from None


def _first_error(error: ValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part))
    if first["type"] == "extra_forbidden":
        return invalid_request(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unrecognized_argument",
        )
    if first["type"] == "missing":
        return invalid_request(
            f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter"
        )
    return invalid_request(
        f"Invalid value for '{param}': {first['msg']}", param=param, code="invalid_value"
    )


def _is_union_tag(part) -> bool:
    """Pydantic names union members in error locations (e.g. 'str', 'list[int]'); drop them."""
    return isinstance(part, str) and (
        "[" in part
        or part in {"str", "int", "float", "bool"}
        or part.startswith(("function-", "constrained-"))
    )
