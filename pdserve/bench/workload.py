"""Benchmark workloads: the list of requests to send, built before the benchmark starts.

- synthetic: prompt and output lengths drawn from a distribution (see `Length`);
- shared-prefix: each prompt is one of N shared prefixes followed by its own suffix;
- mixed: a fraction of long prompts among short ones (e.g. 10% ~1.5K-token documents
  among ~100-token chats);
- conversation: multi-turn chats, each turn resending the history (bench.conversation);
- trace: replay of a Mooncake-format trace (bench.mooncake_trace), or of a JSONL file, one
  request per line:

      {"prompt": "Once upon a time", "max_tokens": 64, "timestamp": 0.0}
      {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "timestamp": 0.25}

  exactly one of "prompt" (a string; sent to /v1/completions, or as one user message to
  /v1/chat/completions) or "messages" (OpenAI chat messages; chat endpoint only); "max_tokens"
  a positive integer; "timestamp" optional, the send offset in seconds from the benchmark
  start, non-decreasing, on every line or on none.

Prompt text is random common English words. Given a tokenizer (a model folder), the text is cut
to the exact token count; without one, one word counts as one token, which is approximate.
"""

import json
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "or has had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "also team three film game season people year these between under while part well "
    "home best early small water light house music family river group place name number "
    "since great area power line end book long road high white party church field point"
).split()


DEFAULT_INPUT_LEN = {
    "synthetic": "1024",
    "shared-prefix": "128",
    "mixed": "normal:100,20",
    "conversation": "128",
}
"""Prompt tokens when --input-len is not given: per workload, the prompt (synthetic), the
suffix after the shared prefix, the short prompts among the long ones (mixed), or the new user
message of each turn (conversation)."""


@dataclass
class BenchRequest:
    """One request to send: a prompt (or chat messages), its token count and `max_tokens`.

    `prefix_blocks`, where the workload knows it, is the prompt as a chain of (key, tokens)
    blocks, equal keys being equal text, from which bench.infinite_cache sets
    `cacheable_tokens`."""

    prompt_tokens: int
    max_tokens: int
    prompt: str | None = None
    messages: list[dict] | None = None
    timestamp: float | None = None  # send offset in seconds (trace replay only)
    prefix_blocks: list[tuple[Hashable, int]] | None = None
    cacheable_tokens: int | None = None


_UNIFORM = re.compile(r"^(\d+)-(\d+)$")
_NORMAL = re.compile(r"^normal:(\d+(?:\.\d+)?),(\d+(?:\.\d+)?)$")


@dataclass
class Length:
    """A token-length distribution: "128" (fixed), "100-200" (uniform, inclusive) or
    "normal:1500,150" (mean, std; rounded, at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "Length":
        text = text.replace(" ", "")
        if text.isdigit() and int(text) > 0:
            return cls("fixed", int(text))
        if (match := _UNIFORM.match(text)) and 0 < int(match[1]) <= int(match[2]):
            return cls("uniform", int(match[1]), int(match[2]))
        if (match := _NORMAL.match(text)) and float(match[1]) >= 1:
            return cls("normal", float(match[1]), float(match[2]))
        raise ValueError(
            f"bad length {text!r}: expected N, LOW-HIGH or normal:MEAN,STD (positive token counts)"
        )

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=n).tolist()
        return np.maximum(1, np.rint(rng.normal(self.a, self.b, size=n))).astype(int).tolist()


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer  # heavy: imported only when a tokenizer is asked for

    return AutoTokenizer.from_pretrained(model_dir)


class PromptText:
    """Makes random prompt text of a given token length, and counts the tokens of a text."""

    def __init__(self, seed: int | None = None, tokenizer=None):
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer

    def make(self, num_tokens: int) -> str:
        text = " ".join(self.rng.choice(WORDS, size=num_tokens))
        if self.tokenizer is None:
            return text
        # Each common word is at least one token, so the cut always has enough tokens.
        return self.tokenizer.decode(
            self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        )

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _from_lengths(
    input_lens: list[int], output_lens: list[int], text: PromptText
) -> list[BenchRequest]:
    requests = []
    for input_len, output_len in zip(input_lens, output_lens, strict=True):
        prompt = text.make(input_len)
        requests.append(BenchRequest(text.count(prompt), output_len, prompt=prompt))
    return requests


def synthetic(
    n: int, input_len: Length, output_len: Length, text: PromptText
) -> list[BenchRequest]:
    return _from_lengths(input_len.sample(text.rng, n), output_len.sample(text.rng, n), text)


def mixed(
    n: int,
    long_fraction: float,
    input_len: Length,
    long_input_len: Length,
    output_len: Length,
    text: PromptText,
) -> list[BenchRequest]:
    """`round(long_fraction * n)` prompts, at random positions, draw from `long_input_len`."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long fraction must be in [0, 1], got {long_fraction}")
    input_lens = input_len.sample(text.rng, n)
    long_lens = long_input_len.sample(text.rng, n)
    for i in text.rng.choice(n, size=round(long_fraction * n), replace=False):
        input_lens[i] = long_lens[i]
    return _from_lengths(input_lens, output_len.sample(text.rng, n), text)


def shared_prefix(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: Length,
    output_len: Length,
    text: PromptText,
) -> list[BenchRequest]:
    """Each prompt is a random one of `num_prefixes` prefixes, then a suffix of its own."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("the number of prefixes and the prefix length must be at least 1")
    prefixes = [text.make(prefix_len) for _ in range(num_prefixes)]
    choices = text.rng.integers(num_prefixes, size=n)
    suffix_lens = suffix_len.sample(text.rng, n)
    output_lens = output_len.sample(text.rng, n)
    requests = []
    prefix_tokens = [text.count(prefix) for prefix in prefixes]
    for i, (choice, suffix, output) in enumerate(
        zip(choices, suffix_lens, output_lens, strict=True)
    ):
        prompt = prefixes[choice] + " " + text.make(suffix)
        tokens = text.count(prompt)
        blocks = [
            (("prefix", int(choice)), prefix_tokens[choice]),
            (("own", i), tokens - prefix_tokens[choice]),
        ]
        requests.append(BenchRequest(tokens, output, prompt=prompt, prefix_blocks=blocks))
    return requests


def trace(path: str | Path, text: PromptText) -> list[BenchRequest]:
    """Load a JSONL trace (format in the module docstring); errors name the file and line."""
    requests: list[BenchRequest] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(_trace_request(json.loads(line), text))
        except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}:{number}: {error}") from None
    if not requests:
        raise ValueError(f"{path}: no requests in trace")
    timestamps = [r.timestamp for r in requests]
    if any(t is None for t in timestamps) and any(t is not None for t in timestamps):
        raise ValueError(f"{path}: 'timestamp' must be on every line or on none")
    if timestamps[0] is not None and any(
        b < a for a, b in zip(timestamps, timestamps[1:], strict=False)
    ):
        raise ValueError(f"{path}: timestamps must be non-decreasing")
    return requests


def _trace_request(line: dict, text: PromptText) -> BenchRequest:
    if not isinstance(line, dict):
        raise ValueError("each line must be a JSON object")
    prompt, messages = line.get("prompt"), line.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError("need exactly one of 'prompt' or 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and "role" in m for m in messages)
    ):
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
    max_tokens = line.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("'max_tokens' must be a positive integer")
    timestamp = line.get("timestamp")
    if timestamp is not None and (not isinstance(timestamp, (int, float)) or timestamp < 0):
        raise ValueError("'timestamp' must be a non-negative number of seconds")
    if prompt is not None:
        tokens = text.count(prompt)
    else:
        tokens = sum(
            text.count(m["content"]) for m in messages if isinstance(m.get("content"), str)
        )
    return BenchRequest(
        tokens, max_tokens, prompt, messages, None if timestamp is None else float(timestamp)
    )
