"""Comparing the router's answers with `vllm serve`'s: the same request to both, each answer
reduced to what a client reads (per choice: text, finish and stop reasons, logprobs, prompt
logprobs; usage), streamed answers put back together first. Logprobs may differ by 1e-4 (the
disaggregated path computes the same values in other batches); everything else is exact."""

import json
import math

from tests.integration.http_client import HTTP

LOGPROB_TOLERANCE = 1e-4
TIMEOUT_S = 120


def ask(base_url: str, endpoint: str, body: dict, headers: dict | None = None) -> dict:
    """One request; the reduced answer (the raw body of a non-200 answer)."""
    response = HTTP.post(
        f"{base_url}/v1/{endpoint}", json=body, headers=headers or {}, timeout=TIMEOUT_S
    )
    assert response.status_code == 200, response.text
    if body.get("stream"):
        return reduced_stream(endpoint, response.text)
    return reduced(endpoint, response.json())


def reduced(endpoint: str, body: dict) -> dict:
    choices = {}
    for choice in body["choices"]:
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        choices[choice["index"]] = {
            "text": text,
            "finish_reason": choice["finish_reason"],
            "stop_reason": choice["stop_reason"],
            "logprobs": choice["logprobs"],
            "prompt_logprobs": choice.get("prompt_logprobs"),
        }
    return {"choices": choices, "usage": _usage(body["usage"])}


def reduced_stream(endpoint: str, text: str) -> dict:
    """The SSE events put back together per choice."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.strip()]
    assert events[-1] == "[DONE]", events[-1]
    choices, usage = {}, None
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        if event.get("usage"):
            usage = _usage(event["usage"])
        for choice in event["choices"]:
            into = choices.setdefault(
                choice["index"],
                {"text": "", "finish_reason": None, "stop_reason": None, "logprobs": None},
            )
            if endpoint == "completions":
                into["text"] += choice["text"]
            else:
                into["text"] += choice["delta"].get("content") or ""
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
                into["stop_reason"] = choice.get("stop_reason")
            if choice.get("logprobs"):
                into["logprobs"] = _joined(into["logprobs"], choice["logprobs"])
    return {"choices": choices, "usage": usage}


def _joined(so_far: dict | None, more: dict) -> dict:
    """Logprobs of consecutive chunks as one (completions: per-key lists; chat: content)."""
    if so_far is None:
        return more
    return {key: so_far[key] + more[key] for key in more}


def _usage(usage: dict) -> tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


def assert_same(ours, theirs, path: str = "answer") -> None:
    """Equal, but floats only within LOGPROB_TOLERANCE."""
    if isinstance(theirs, float) and isinstance(ours, float | int):
        assert math.isclose(ours, theirs, abs_tol=LOGPROB_TOLERANCE), f"{path}: {ours} != {theirs}"
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), (
            f"{path}: keys {sorted(ours)} != {sorted(theirs)}"
        )
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list | tuple):
        assert isinstance(ours, list | tuple) and len(ours) == len(theirs), (
            f"{path}: {ours!r} != {theirs!r}"
        )
        for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(mine, other, f"{path}[{index}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"
