"""The worker protocol's sampling parameters as vLLM's SamplingParams, for each choice.

The router sends a few fields typed (those it reads itself) and the rest by vLLM's own names
(`vllm_fields_json`); they go through `SamplingParams.from_optional`, the constructor vLLM's own
OpenAI server uses, so they get vLLM's conversions (logit_bias keys to token ids, clamped) and
vLLM's validation. A name that is not one of its parameters is refused.
"""

import functools
import inspect
import json

from pdserve.protocol import worker_pb2

# Parameters the protocol carries as typed fields (or the worker sets), never by name.
TYPED = frozenset(
    {
        "n",
        "min_tokens",
        "extra_args",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "logprobs",
        "prompt_logprobs",
        "output_kind",
    }
)


@functools.cache
def _by_name() -> frozenset[str]:
    """vLLM's parameters the router may pass by name."""
    from vllm import SamplingParams

    return frozenset(inspect.signature(SamplingParams.from_optional).parameters) - TYPED


def _objects(fields: dict) -> dict:
    """Fields vLLM takes as objects, built from their JSON mappings."""
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    for name, kind in (
        ("structured_outputs", StructuredOutputsParams),
        ("repetition_detection", RepetitionDetectionParams),
    ):
        if isinstance(fields.get(name), dict):
            try:
                fields[name] = kind(**fields[name])
            except TypeError as error:
                raise ValueError(f"{name}: {error}") from None
    return fields


def choice_count(params: worker_pb2.SamplingParams) -> int:
    return params.n or 1


def to_vllm_sampling(
    params: worker_pb2.SamplingParams, extra_args: dict | None = None, choice: int = 0
):
    """vLLM's SamplingParams for one choice (`choice` of `n`: with a seed, choice i samples with
    seed + i, as vLLM's own fan-out does; only choice 0 computes prompt logprobs, the others
    reuse the prompt's KV from the prefix cache, which vLLM skips for prompt logprobs). A
    ValueError (the client's 400) when vLLM refuses a value or a field is not vLLM's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    fields = json.loads(params.vllm_fields_json or "{}")
    unknown = sorted(set(fields) - _by_name())
    if unknown:
        raise ValueError(f"not vLLM sampling parameters: {', '.join(unknown)}")
    seed = params.seed if params.HasField("seed") else None
    return SamplingParams.from_optional(
        **_objects(fields),
        n=1,
        min_tokens=params.min_tokens,
        extra_args=extra_args,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=None if seed is None else seed + choice,
        stop=list(params.stop) or None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=(
            params.prompt_logprobs if params.HasField("prompt_logprobs") and choice == 0 else None
        ),
        output_kind=RequestOutputKind.DELTA,
    )
