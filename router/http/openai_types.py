"""The OpenAI request bodies pdserve accepts: OpenAI's fields and vLLM's extensions, as vLLM's
own server takes them (same names, defaults and limits), validated strictly.

Wrong types are never coerced ("5" is not an int). A field neither OpenAI's nor vLLM's is
ignored with a warning, as vLLM's server does; a known field pdserve does not implement is
refused by name (UNSUPPORTED), never silently dropped. null means "not set" everywhere.
"""

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from router.http.errors import ErrorCode, OpenAIError, invalid_request, unsupported_parameter

log = logging.getLogger("pdserve.router")

# Known parameters (OpenAI's or vLLM's) that pdserve does not implement, with why.
UNSUPPORTED = {
    "tools": "tool calling needs a tool parser, which pdserve does not run",
    "tool_choice": "tool calling needs a tool parser, which pdserve does not run",
    "functions": "tool calling needs a tool parser, which pdserve does not run",
    "function_call": "tool calling needs a tool parser, which pdserve does not run",
    "parallel_tool_calls": "tool calling needs a tool parser, which pdserve does not run",
    "reasoning_effort": "reasoning models' templates are not supported",
    "include_reasoning": "reasoning models' templates are not supported",
    "suffix": "is not supported (nor by vLLM)",
    "modalities": "pdserve serves text only",
    "audio": "pdserve serves text only",
    "prediction": "predicted outputs are not supported (nor by vLLM)",
    "service_tier": "has no meaning on pdserve",
    "store": "stored completions are not supported",
    "metadata": "stored completions are not supported",
    "web_search_options": "web search is not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "kv_transfer_params": "pdserve moves KV itself; it takes no transfer parameters",
    "ec_transfer_params": "encoder caches are not supported",
    "vllm_xargs": "custom engine extensions are not supported",
    "routed_experts_prompt_start": "routed-expert data is not returned",
    "media_io_kwargs": "pdserve serves text only",
    "mm_processor_kwargs": "pdserve serves text only",
    "documents": "custom chat templates are not supported",
    "chat_template": "custom chat templates are not supported",
    "chat_template_kwargs": "custom chat templates are not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported; send a shorter prompt",
    "truncation_side": "prompt truncation is not supported; send a shorter prompt",
    "watermarking": "watermarking is not supported",
}

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
    "logit_bias",
    "allowed_token_ids",
    "logprob_token_ids",
    "repetition_detection",
    "thinking_token_budget",
)
MAX_STOP_CHARS = 1024  # each stop string is searched for in the text after every token
MAX_STOP_STRINGS = 64
MAX_CHOICES = 128  # n (and best_of): choices of one request, each its own engine request
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
GREEDY_TEMPERATURE = 1e-5  # below: greedy, as vLLM counts it
INT32_MAX = 2**31 - 1  # the worker protocol's int32 fields (top_k, logprobs, token ids)
UINT32_MAX = 2**32 - 1  # and its uint32 ones (min_tokens)
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Logprobs = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1: the whole vocabulary
# Structured-output constraints are compiled in the engine (xgrammar): each one's size, and a
# JSON schema's nesting, are bounded.
MAX_CONSTRAINT_CHARS = 64 << 10  # a regex, grammar, structural tag or schema (as JSON)
MAX_SCHEMA_DEPTH = 64  # arrays and objects inside each other in a JSON schema
MAX_CHOICES_CONSTRAINT = 1024  # strings of a `choice` constraint
# A client's request_id goes into the x-request-id header and the workers' request ids:
# visible ASCII only (no space, no control or non-Latin-1 character a header cannot carry).
RequestId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[!-~]+$")]
# vLLM's limits on a cache salt: at most 128 characters, none of @ / \ NUL.
CacheSalt = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^@/\\\x00]+$")]


def _bounded_schema(schema):
    """A JSON schema (an object, or its JSON text) within MAX_CONSTRAINT_CHARS and
    MAX_SCHEMA_DEPTH; text that is not JSON is left to the engine to refuse."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except RecursionError:
            raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH}") from None
        except ValueError:
            return schema
    else:
        parsed = schema
    if _depth(parsed) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH}")
    if not isinstance(schema, str) and len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"the schema is longer than {MAX_CONSTRAINT_CHARS} characters as JSON")
    return schema


def _depth(value) -> int:
    """How deep arrays and objects nest in `value` (0: neither), up to one past the limit."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_SCHEMA_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


ConstraintText = Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)]
Schema = Annotated[dict[str, Any], AfterValidator(_bounded_schema)]
SchemaOrText = Annotated[ConstraintText | dict[str, Any], AfterValidator(_bounded_schema)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RequestModel(StrictModel):
    """A request body: fields outside the model are kept aside (`ignored_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(StrictModel):
    name: str = "schema"
    description: str | None = None
    json_schema: Schema = Field(alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormatParam(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(StrictModel):
    """vLLM's StructuredOutputsParams: one constraint (json, regex, choice, grammar,
    json_object or structural_tag) and its options."""

    json_: SchemaOrText | None = Field(default=None, alias="json")
    regex: ConstraintText | None = None
    choice: (
        Annotated[list[ConstraintText], Field(min_length=1, max_length=MAX_CHOICES_CONSTRAINT)]
        | None
    ) = None
    grammar: ConstraintText | None = None
    json_object: bool | None = None
    structural_tag: ConstraintText | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: ConstraintText | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @model_validator(mode="after")
    def one_constraint(self):
        kinds = ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
        if sum(getattr(self, kind) is not None for kind in kinds) > 1:
            raise ValueError(
                "only one kind of constraint: json, regex, choice, grammar, json_object or "
                "structural_tag"
            )
        if self.choice is not None and sum(map(len, self.choice)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"the choices are longer than {MAX_CONSTRAINT_CHARS} characters")
        return self


class RepetitionDetection(StrictModel):
    max_pattern_size: Annotated[int, Field(ge=0)] = 0
    min_pattern_size: Annotated[int, Field(ge=0)] = 0
    min_count: Annotated[int, Field(ge=0)] = 0


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # unset: the served model, as vLLM
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0  # 0 or -1: no top-k
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    ignore_eos: bool = False  # vLLM's extension, used by benchmarks
    # vLLM's sampling extensions, with vLLM's ranges; unset (or null): vLLM's default.
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2**31)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=64)] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    repetition_detection: RepetitionDetection | None = None
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None
    prompt_logprobs: Logprobs | None = None
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputs | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    use_beam_search: Literal[False] = False  # beam search is not supported
    length_penalty: float = 1.0  # beam search only: no effect
    # The router's admission class (router/flow/admission_gate.py; smaller first); not sent on: the
    # workers do not schedule by priority.
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63)] = 0
    request_id: RequestId | None = None
    # Salts the prompt's blocks in the prefix caches, within its API key's salt
    # (router/http/api_keys.py)
    cache_salt: CacheSalt | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted, no effect: vLLM's server ignores them on these endpoints too, or they only
    # tune how output is chunked.
    session_id: str | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    return_token_offsets: bool = False
    mm_payload: Literal["tensors", "none"] = "tensors"

    @model_validator(mode="after")
    def vllm_rules(self):
        """The cross-field rules vLLM's server applies, with its messages."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if self.prompt_logprobs is not None and self.stream and self.prompt_logprobs != 0:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if self.choice_count() > 1 and self.temperature < GREEDY_TEMPERATURE:
            name = "n" if self.best_of is None else "best_of"
            raise ValueError(
                f"{name} must be 1 when using greedy sampling, got {self.choice_count()}."
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed: the best are known at the end")
        if self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise ValueError(
                    "When response_format type is 'json_schema', the 'json_schema' field must "
                    "be provided."
                )
        if self.logprob_token_ids and self.output_logprobs() is None:
            raise ValueError("when using `logprob_token_ids`, `logprobs` must be set.")
        return self

    def vllm_fields(self) -> dict:
        """The VLLM_PASS_THROUGH fields the request set and the structured-output constraint
        (response_format as vLLM turns it into one): vLLM applies them as they are."""
        fields = {
            name: _plain(getattr(self, name))
            for name in VLLM_PASS_THROUGH
            if getattr(self, name) is not None
        }
        if (constraint := self.structured_output()) is not None:
            fields["structured_outputs"] = constraint
        return fields

    def structured_output(self) -> dict | None:
        """vLLM's structured_outputs, with response_format applied over it as vLLM does."""
        constraint = (
            self.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
            if self.structured_outputs is not None
            else None
        )
        response_format = self.response_format
        if response_format is None or response_format.type == "text":
            return constraint
        if response_format.type == "json_object":
            override = {"json_object": True}
        else:
            override = {"json": response_format.json_schema.json_schema}
        kinds = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        kept = {k: v for k, v in (constraint or {}).items() if k not in kinds}
        return {**kept, **override}

    def output_logprobs(self) -> int | None:
        """Top logprobs per output token (None: none asked)."""
        raise NotImplementedError

    def choice_count(self) -> int:
        """Choices sampled per prompt: best_of, of which n are returned."""
        return self.best_of or self.n

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _plain(value):
    return value.model_dump() if isinstance(value, BaseModel) else value


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
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    echo: bool = False  # the reply starts with the last message when it is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def top_logprobs_need_logprobs(self):
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        return self

    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_asked(self) -> int | None:
        """As vLLM: with echo, top_logprobs for the prompt too."""
        if self.prompt_logprobs is None and self.echo and self.logprobs:
            return self.top_logprobs or 0
        return self.prompt_logprobs


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # Text or token ids, or a batch of either (one response, n choices per prompt, in order).
    prompt: (
        Annotated[str, Field(min_length=1)]
        | TokenIds
        | Annotated[
            list[Annotated[str, Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with echo, the prompt alone
    logprobs: Logprobs | None = None
    echo: bool = False  # the prompt's text (and, with logprobs, its logprobs) first
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def no_tokens_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        return self

    def max_tokens_asked(self) -> int | None:
        return self.max_tokens

    def output_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """As vLLM: with echo, logprobs for the prompt too."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt, or several."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


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
    unsupported = sorted(UNSUPPORTED.keys() & body.keys())
    if unsupported and not _no_tools(body):
        raise unsupported_parameter(unsupported[0], UNSUPPORTED[unsupported[0]])
    try:
        parsed = model.model_validate(body)
    except ValidationError as error:
        raise _first_error(error) from None
    if isinstance(parsed, RequestModel) and parsed.ignored_fields():
        log.warning(
            "The following fields were present in the request but ignored: %s",
            ", ".join(parsed.ignored_fields()),
        )
    return parsed


def _no_tools(body: dict) -> bool:
    """What clients send when they use no tools: tool_choice "none" and no tools."""
    return set(UNSUPPORTED.keys() & body.keys()) <= {"tool_choice", "tools"} and (
        body.get("tool_choice", "none") == "none" and not body.get("tools")
    )


def _first_error(error: ValidationError) -> OpenAIError:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if not _is_union_tag(part))
    if not param:  # a rule across fields: its message says which
        return invalid_request(
            first["msg"].removeprefix("Value error, "), code=ErrorCode.INVALID_VALUE
        )
    if first["type"] == "extra_forbidden":
        return invalid_request(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code=ErrorCode.UNRECOGNIZED_ARGUMENT,
        )
    if first["type"] == "missing":
        return invalid_request(
            f"Missing required parameter: '{param}'",
            param=param,
            code=ErrorCode.MISSING_REQUIRED_PARAMETER,
        )
    return invalid_request(
        f"Invalid value for '{param}': {first['msg']}", param=param, code=ErrorCode.INVALID_VALUE
    )


def _is_union_tag(part) -> bool:
    """Pydantic names union members in error locations (e.g. 'str', 'list[int]'); drop them."""
    return isinstance(part, str) and (
        "[" in part
        or part in {"str", "int", "float", "bool"}
        or part.startswith(("function-", "constrained-"))
    )
