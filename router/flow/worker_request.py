"""Translation to the worker protocol: the GenerateRequest (token ids, sampling) a worker runs
for one prompt of an OpenAI request, checked against the model's context length."""

import json

from pdserve.protocol import worker_pb2
from router.http.errors import ErrorCode, context_length_exceeded, invalid_request
from router.http.openai_types import SamplingFields


def generate_request(
    parsed: SamplingFields,
    request_id: str,
    prompt_ids: list[int],
    max_model_len: int,
    default_max_tokens: int,
    param: str,
    cache_salt: str = "",
) -> worker_pb2.GenerateRequest:
    """`param`: the field that holds the prompt ("messages" or "prompt"), named in a 400.
    `cache_salt`: what salts the prompt's blocks in the engine's prefix cache ("": none)."""
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling_params(parsed, len(prompt_ids), max_model_len, default_max_tokens, param),
        cache_salt=cache_salt,
    )


def sampling_params(
    parsed: SamplingFields,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
    param: str,
) -> worker_pb2.SamplingParams:
    max_tokens = _max_tokens(parsed, prompt_tokens, max_model_len, default_max_tokens, param)
    sampling = worker_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=parsed.temperature,
        top_p=parsed.top_p,
        top_k=parsed.top_k,
        stop=parsed.stop_list(),
        presence_penalty=parsed.presence_penalty,
        frequency_penalty=parsed.frequency_penalty,
        ignore_eos=parsed.ignore_eos,
        min_tokens=parsed.min_tokens or 0,
        vllm_fields_json=json.dumps(parsed.vllm_fields()) if parsed.vllm_fields() else "",
    )
    if sampling.min_tokens > max_tokens:
        raise invalid_request(
            f"min_tokens ({sampling.min_tokens}) must be at most max_tokens ({max_tokens})",
            param="min_tokens",
            code=ErrorCode.INVALID_VALUE,
        )
    if parsed.seed is not None:
        sampling.seed = parsed.seed
    if parsed.choice_count() > 1:
        sampling.n = parsed.choice_count()
    logprobs = parsed.output_logprobs()
    if logprobs is None and parsed.choice_count() > parsed.n:
        logprobs = 0  # best_of ranks choices by their cumulative logprob
    if logprobs is not None:
        sampling.logprobs = logprobs
    if (prompt_logprobs := parsed.prompt_logprobs_asked()) is not None:
        sampling.prompt_logprobs = prompt_logprobs
    return sampling


def _max_tokens(
    parsed: SamplingFields,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int,
    param: str,
) -> int:
    """What the client asked for, or the default within the room the prompt leaves; a 400 when
    the prompt and the tokens asked do not fit the context."""
    asked = parsed.max_tokens_asked()
    if asked == 0:  # echo alone (completions): one token computed, none returned
        asked = 1
    room = max_model_len - prompt_tokens
    max_tokens = asked if asked is not None else min(default_max_tokens, room)
    if max_tokens > room or room < 1:
        raise context_length_exceeded(prompt_tokens, max(max_tokens, 1), max_model_len, param)
    return max_tokens
