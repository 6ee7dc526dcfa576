"""Mooncake-format trace replay in `pdserve bench`: equal hash ids give equal text blocks (exact
token blocks with a tokenizer), line errors name the line and exit 2, the infinite-cache bound
from hash ids, and timestamps honoured against FakeOpenAIServer
(tests/unit/fake_openai_server.py)."""

import argparse
import json
import re
import time

import pytest

from pdserve.bench import command, mooncake_trace
from pdserve.bench.infinite_cache import mark_cacheable
from pdserve.bench.workload import WORDS, BenchRequest, Length, PromptText, shared_prefix
from tests.unit.fake_openai_server import FakeOpenAIServer

pytestmark = pytest.mark.timeout(60)


class FakeWordTokenizer:
    """Stands in for a byte-level BPE tokenizer: " word" pieces are tokens, as are a few pieces
    that are no single-token words (no leading space, upper case, and " unk" that encodes as two
    tokens); anything else is token 0."""

    def __init__(self):
        self.vocab = ["<unk>", "ing", " Dog", " unk"] + [" " + word for word in WORDS]
        self.ids = {piece: i for i, piece in enumerate(self.vocab)}

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        if text == " unk":
            return [0, 0]
        return [self.ids.get(piece, 0) for piece in re.findall(r" ?\S+", text)]


def write(tmp_path, *lines) -> str:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(
        "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    )
    return str(path)


def line(timestamp, input_length, hash_ids, output_length=2) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


TRACE = [
    line(0, 20, [1, 2, 3]),  # blocks of 8: 8 + 8 + 4 tokens
    line(250, 17, [1, 2, 9]),  # the same first two blocks
    line(250, 5, [7]),  # nothing shared
    line(600, 20, [1, 2, 3]),  # the first request again
]


def test_equal_hash_ids_are_equal_token_blocks_with_a_tokenizer(tmp_path):
    tokenizer = FakeWordTokenizer()
    a, b, c, again = mooncake_trace.trace(write(tmp_path, *TRACE), 8, PromptText(0, tokenizer))
    ids = [tokenizer.encode(r.prompt) for r in (a, b, c, again)]
    assert [len(i) for i in ids] == [20, 17, 5, 20]  # exactly input_length tokens
    assert 0 not in {t for i in ids for t in i}  # only single-token " word" pieces
    assert tokenizer.ids[" Dog"] not in ids[0] and tokenizer.ids["ing"] not in ids[0]
    assert ids[1][:16] == ids[0][:16] and ids[1][16] != ids[0][16]
    assert b.prompt.startswith(a.prompt[: len(tokenizer.decode(ids[0][:16]))])
    assert ids[2][0] != ids[0][0] and again.prompt == a.prompt
    assert [r.prompt_tokens for r in (a, b, c)] == [20, 17, 5]
    assert [r.max_tokens for r in (a, b, c)] == [2, 2, 2]


def test_without_a_tokenizer_blocks_are_words_and_the_seed_picks_the_text(tmp_path):
    path = write(tmp_path, *TRACE)
    a, b, c, _ = mooncake_trace.trace(path, 8, PromptText(0))
    words = [r.prompt.split() for r in (a, b, c)]
    assert [len(w) for w in words] == [20, 17, 5]
    assert words[1][:16] == words[0][:16] and words[1][16:] != words[0][16:17]
    assert mooncake_trace.trace(path, 8, PromptText(0))[0].prompt == a.prompt
    assert mooncake_trace.trace(path, 8, PromptText(1))[0].prompt != a.prompt


def test_a_tokenizer_without_single_token_words_is_refused(tmp_path):
    class CharTokenizer(FakeWordTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [0] * len(text)

    with pytest.raises(ValueError, match="single-token ' word' pieces"):
        mooncake_trace.trace(write(tmp_path, *TRACE), 8, PromptText(0, CharTokenizer()))


def test_timestamps_become_offsets_from_the_first_line(tmp_path):
    path = write(tmp_path, *[line(t, 4, [1]) for t in (1000, 1250, 1250, 3000)], "{not json")
    requests = mooncake_trace.trace(path, 8, PromptText(0), limit=4)  # the bad line: not read
    assert [r.timestamp for r in requests] == [0.0, 0.25, 0.25, 2.0]


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], "mooncake.jsonl:1:"),
        ([line(0, 4, [1]), "[1, 2]"], "mooncake.jsonl:2: each line must be a JSON object"),
        ([line(-1, 4, [1])], "'timestamp' must be a non-negative number of milliseconds"),
        ([line(0, 0, [])], "'input_length' must be a positive integer"),
        ([line(0, 4, [1], output_length=0)], "'output_length' must be a positive integer"),
        ([line(0, 4, [-1])], "'hash_ids' must be a list of non-negative integers"),
        ([line(0, 4, "1")], "'hash_ids' must be a list"),
        ([line(0, 20, [1, 2])], "2 hash ids for 20 tokens: expected 3 with blocks of 8"),
        ([line(5, 4, [1]), line(4, 4, [1])], "mooncake.jsonl:2: timestamps must be non-decreasing"),
        ([""], "no requests"),
    ],
)
def test_trace_errors_name_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mooncake_trace.trace(write(tmp_path, *lines), 8, PromptText(0))


def test_infinite_cache_bound_from_hash_ids(tmp_path):
    trace = [*TRACE, line(700, 4, [1]), line(800, 12, [7, 8]), line(900, 16, [10, 2])]
    requests = mooncake_trace.trace(write(tmp_path, *trace), 8, PromptText(0))
    mark_cacheable(requests)
    # [1,2,3]: new; [1,2,9]: two held blocks; [7] (5 tokens): new; [1,2,3] again: all;
    # [1] (4 of its 8 tokens): held; [7, 8]: block 7 held with only 5 of its 8 tokens, so the
    # hit stops there; [10, 2]: block 2 is held, but after a block that is not.
    assert [r.cacheable_tokens for r in requests] == [0, 16, 0, 20, 4, 5, 0]
    mark_cacheable(requests, warmed=2)  # the first two were sent once before: a warm-up
    assert [r.cacheable_tokens for r in requests] == [20, 17, 0, 20, 4, 5, 0]


def test_infinite_cache_bound_of_shared_prefixes_and_of_unknown_prompts():
    requests = shared_prefix(6, 2, 10, Length.parse("3"), Length.parse("2"), PromptText(0))
    mark_cacheable(requests)
    seen, expected = set(), []
    for r in requests:
        prefix = " ".join(r.prompt.split()[:10])
        expected.append(10 if prefix in seen else 0)
        seen.add(prefix)
    assert [r.cacheable_tokens for r in requests] == expected and 0 < sum(expected) < 60
    unknown = [BenchRequest(3, 2, prompt="a b c")]
    mark_cacheable(unknown)
    assert unknown[0].cacheable_tokens is None


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_replays_a_mooncake_trace_at_its_timestamps(tmp_path, capsys):
    trace = [line(0, 20, [1, 2, 3]), line(300, 17, [1, 2, 9]), line(600, 20, [1, 2, 3])]
    server = FakeOpenAIServer().start()
    try:
        args = bench_args(
            "--url", server.url, "--workload", "trace", "--trace-format", "mooncake",
            "--trace", write(tmp_path, *trace), "--trace-block-size", "8", "--warmup", "0",
            "--no-progress", "--output-json", str(tmp_path / "bench.json"),
        )  # fmt: skip
        started = time.perf_counter()  # the fake's clock
        assert args.run(args) == 0
        arrived = [received.arrived - started for received in server.log]
    finally:
        server.stop()
    assert len(arrived) == 3
    # Sent at 0, 0.3 and 0.6 s after the run began (set-up comes first): never early; late by
    # no more than the run's set-up and a loaded host's scheduling.
    for offset, at in zip((0.0, 0.3, 0.6), arrived, strict=True):
        assert offset <= at < offset + 1.0, arrived
    assert arrived == sorted(arrived)
    # Without a tokenizer a block is 8 words; the fake counts words and caches prompts.
    document = json.loads((tmp_path / "bench.json").read_text())
    assert [r["cacheable_tokens"] for r in document["requests"]] == [0, 16, 20]
    assert document["summary"]["infinite_cache_hit_rate"] == pytest.approx(36 / 57)
    assert document["summary"]["prefix_hit_rate"] == pytest.approx(36 / 57)
    assert "(measured: 100% of it)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trace-format", "mooncake"], "--trace-format goes with --workload trace"),
        (
            ["--workload", "trace", "--trace-format", "mooncake", "--trace-block-size", "0"],
            "at least 1",
        ),
    ],
)
def test_bad_mooncake_options_exit_2(tmp_path, argv, message, capsys):
    path = write(tmp_path, line(0, 4, [1]))
    extra = ["--trace", path] if "trace" in argv else []
    args = bench_args("--url", "http://127.0.0.1:9", *argv, *extra)
    assert args.run(args) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_trace_line_exits_2(tmp_path, capsys):
    path = write(tmp_path, line(0, 4, [1]), {"timestamp": 5, "input_length": 4})
    args = bench_args(
        "--url",
        "http://127.0.0.1:9",
        "--workload",
        "trace",
        "--trace-format",
        "mooncake",
        "--trace",
        path,
    )
    assert args.run(args) == 2
    error = capsys.readouterr().err
    assert (
        error.startswith("pdserve bench: error:") and "mooncake.jsonl:2: 'output_length'" in error
    )
