"""Replay of a Mooncake-format trace (github.com/kvcache-ai/Mooncake, FAST'25 traces): one JSON
object per line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

with the send time in milliseconds, the prompt and output lengths in tokens, and one hash id per
block of the prompt (block size 512 tokens in Mooncake's traces; the last block may be partial).
Equal hash ids are equal blocks, so the prompts here share exactly the prefixes the trace's did:
each hash id gets its own text, drawn by a random stream seeded with the run's seed and the id.

A block's text is made of pieces that are one token each. With a tokenizer (--tokenizer) the
pieces are the vocabulary's " word" tokens that encode back to that one token, so a prompt has
exactly `input_length` tokens and each block exactly the block size (on the completions endpoint:
the chat endpoint adds its template's tokens in front, which shifts every block by as much).
Without one, the pieces are common English words, about one token each: prefix sharing is still
reproduced (equal ids, equal text) but lengths and block edges are only approximate.

Send offsets are the timestamps minus the first line's, in seconds; the requests carry
`prefix_blocks` so that bench.infinite_cache can compute the trace's hit-rate bound.
"""

import json
import math
import re
from pathlib import Path

import numpy as np

from pdserve.bench.workload import WORDS, BenchRequest, PromptText

DEFAULT_BLOCK_SIZE = 512
MIN_PIECES = 100  # fewer single-token words than this would make blocks too repetitive
_WORD = re.compile(r" [a-z]+")


def single_token_words(tokenizer) -> list[str]:
    """The vocabulary's " word" pieces that the tokenizer encodes as exactly that one token; a
    text of such pieces has one token per piece (byte-level BPE tokenizers split before each
    space: GPT-2, Llama 3, Qwen, SmolLM)."""
    pieces = []
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        if _WORD.fullmatch(piece) and tokenizer.encode(piece, add_special_tokens=False) == [
            token_id
        ]:
            pieces.append(piece)
    if len(pieces) < MIN_PIECES:
        raise ValueError(
            f"the tokenizer has {len(pieces)} single-token ' word' pieces (at least {MIN_PIECES} "
            "needed to build exact blocks): leave out --tokenizer for approximate lengths"
        )
    return pieces


class BlockText:
    """The text of each hash id's block: `block_size` pieces, the same for an id every time."""

    def __init__(self, block_size: int, text: PromptText):
        if block_size < 1:
            raise ValueError(f"the trace block size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.seed = int(text.rng.integers(2**32))
        tokenizer = text.tokenizer
        self.pieces = single_token_words(tokenizer) if tokenizer else [" " + w for w in WORDS]

    def prompt(self, hash_ids: list[int], input_length: int) -> str:
        pieces = []
        for hash_id in hash_ids:
            rng = np.random.default_rng([self.seed, hash_id])
            pieces.extend(
                self.pieces[i] for i in rng.integers(len(self.pieces), size=self.block_size)
            )
        return "".join(pieces[:input_length])


def trace(
    path: str | Path, block_size: int, text: PromptText, limit: int | None = None
) -> list[BenchRequest]:
    """Load a Mooncake trace, or its first `limit` requests (a whole trace's prompts can be
    gigabytes of text); errors name the file and line."""
    blocks = BlockText(block_size, text)
    lines: list[tuple[float, BenchRequest]] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if len(lines) == limit:
            break
        if not line.strip():
            continue
        try:
            timestamp_ms, request = _request(json.loads(line), blocks)
            if lines and timestamp_ms < lines[-1][0]:
                raise ValueError("timestamps must be non-decreasing")
        except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{path}:{number}: {error}") from None
        lines.append((timestamp_ms, request))
    if not lines:
        raise ValueError(f"{path}: no requests in trace")
    for timestamp_ms, request in lines:
        request.timestamp = (timestamp_ms - lines[0][0]) / 1000
    return [request for _, request in lines]


def _request(line: dict, blocks: BlockText) -> tuple[float, BenchRequest]:
    """(timestamp in ms, the request) of one line."""
    if not isinstance(line, dict):
        raise ValueError("each line must be a JSON object")
    timestamp = line.get("timestamp")
    if not _number(timestamp) or timestamp < 0:
        raise ValueError("'timestamp' must be a non-negative number of milliseconds")
    for key in ("input_length", "output_length"):
        if not _integer(line.get(key)) or line[key] < 1:
            raise ValueError(f"'{key}' must be a positive integer")
    hash_ids = line.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(_integer(h) and h >= 0 for h in hash_ids):
        raise ValueError("'hash_ids' must be a list of non-negative integers")
    input_length, size = line["input_length"], blocks.block_size
    if len(hash_ids) != math.ceil(input_length / size):
        raise ValueError(
            f"{len(hash_ids)} hash ids for {input_length} tokens: expected "
            f"{math.ceil(input_length / size)} with blocks of {size} tokens (--trace-block-size)"
        )
    request = BenchRequest(
        input_length,
        line["output_length"],
        prompt=blocks.prompt(hash_ids, input_length),
        prefix_blocks=[(h, min(size, input_length - i * size)) for i, h in enumerate(hash_ids)],
    )
    return timestamp, request


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
