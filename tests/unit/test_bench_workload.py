"""Workload generators of `pdserve bench`: length distributions, synthetic, shared-prefix and
mixed prompts, and JSONL trace parsing."""

import json

import pytest

from pdserve.bench import workload
from pdserve.bench.workload import Length, PromptText

pytestmark = pytest.mark.timeout(60)


class FakeCharTokenizer:
    """Stands in for a Hugging Face tokenizer: one token per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize(
    "text, low, high", [("128", 128, 128), ("10-20", 10, 20), ("normal:100,10", 1, 10_000)]
)
def test_length_distributions(text, low, high):
    lengths = Length.parse(text).sample(PromptText(0).rng, 500)
    assert len(lengths) == 500 and all(low <= n <= high for n in lengths)
    if text == "10-20":
        assert set(lengths) == set(range(10, 21))
    if text.startswith("normal"):
        assert 95 < sum(lengths) / 500 < 105


@pytest.mark.parametrize("text", ["", "0", "-5", "20-10", "abc", "normal:100", "normal:0,1"])
def test_length_rejects_bad_input(text):
    with pytest.raises(ValueError, match="bad length"):
        Length.parse(text)


def test_synthetic_is_seeded_and_sized():
    def make(seed):
        return workload.synthetic(20, Length.parse("10-50"), Length.parse("16"), PromptText(seed))

    requests = make(3)
    assert [r.prompt for r in requests] == [r.prompt for r in make(3)]
    assert [r.prompt for r in requests] != [r.prompt for r in make(4)]
    assert all(
        len(r.prompt.split()) == r.prompt_tokens and 10 <= r.prompt_tokens <= 50 for r in requests
    )
    assert {r.max_tokens for r in requests} == {16}


def test_tokenizer_cuts_prompts_to_exact_length():
    text = PromptText(0, FakeCharTokenizer())
    requests = workload.synthetic(5, Length.parse("37"), Length.parse("4"), text)
    assert all(len(r.prompt) == 37 == r.prompt_tokens for r in requests)


def test_shared_prefix_prompts():
    requests = workload.shared_prefix(
        40, 3, 20, Length.parse("5"), Length.parse("8"), PromptText(0)
    )
    prefixes = {" ".join(r.prompt.split()[:20]) for r in requests}
    assert len(prefixes) == 3
    assert all(r.prompt_tokens == 25 for r in requests)
    assert len({r.prompt for r in requests}) == 40  # the suffixes differ


def test_mixed_has_the_requested_fraction_of_long_prompts():
    requests = workload.mixed(
        50, 0.1, Length.parse("100"), Length.parse("1500"), Length.parse("8"), PromptText(0)
    )
    assert sorted(r.prompt_tokens for r in requests) == [100] * 45 + [1500] * 5
    with pytest.raises(ValueError):
        workload.mixed(
            5, 1.5, Length.parse("1"), Length.parse("2"), Length.parse("1"), PromptText(0)
        )


def write_trace(tmp_path, *lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    )
    return str(path)


def test_trace_replay(tmp_path):
    path = write_trace(
        tmp_path,
        {"prompt": "one two three", "max_tokens": 4, "timestamp": 0},
        "",
        {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2, "timestamp": 0.5},
    )
    first, second = workload.trace(path, PromptText(0))
    assert (first.prompt, first.prompt_tokens, first.max_tokens, first.timestamp) == (
        "one two three",
        3,
        4,
        0.0,
    )
    assert (
        second.messages[0]["content"] == "hi there"
        and second.prompt_tokens == 2
        and second.timestamp == 0.5
    )


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], "trace.jsonl:1:"),
        ([{"max_tokens": 3}], "exactly one of 'prompt' or 'messages'"),
        ([{"prompt": "a", "max_tokens": 0}], "'max_tokens' must be a positive integer"),
        (
            [{"prompt": "a", "max_tokens": 1}, {"prompt": "b", "max_tokens": 1, "timestamp": 1}],
            "every line or on none",
        ),
        (
            [
                {"prompt": "a", "max_tokens": 1, "timestamp": 2},
                {"prompt": "b", "max_tokens": 1, "timestamp": 1},
            ],
            "non-decreasing",
        ),
        ([""], "no requests"),
    ],
)
def test_trace_errors_name_the_line(tmp_path, lines, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        workload.trace(write_trace(tmp_path, *lines), PromptText(0))
