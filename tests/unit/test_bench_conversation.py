"""The conversation workload of `pdserve bench` against FakeOpenAIServer (a stand-in, not the
pdserve router; see tests/unit/fake_openai_server.py): each turn resends the history with the
replies the fake actually streamed, after the reply and the think time; records carry their
turn; per-turn TTFT and hit rates; bad options exit 2."""

import argparse
import asyncio
import json

import pytest

from pdserve.bench import command, conversation, sweep_command
from pdserve.bench.client import Target
from pdserve.bench.conversation import Conversation, Turn
from pdserve.bench.workload import Length, PromptText
from tests.unit.fake_openai_server import FakeOpenAIServer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake():
    server = FakeOpenAIServer(ttft_s=0.02, itl_s=0.01).start()  # what is asserted is the order
    yield server
    server.stop()


def hold(server: FakeOpenAIServer, talks: list[Conversation], **schedule):
    schedule.setdefault("offsets", [0.0] * len(talks))
    return asyncio.run(
        conversation.run(
            talks, Target(server.url, "fake-model", "chat"), progress=False, **schedule
        )
    )


def test_each_turn_resends_the_history_with_the_actual_replies(fake):
    talks = conversation.conversations(
        2, 3, Length.parse("4"), Length.parse("3"), 0.2, PromptText(0)
    )
    records, duration = hold(fake, talks)

    assert len(fake.log) == 6 and all(r.ok for r in records)
    assert fake.max_in_flight == 2  # the two conversations run side by side
    for index, talk in enumerate(talks):
        theirs = [r for r in fake.log if r.body["messages"][0]["content"] == talk.turns[0].message]
        assert len(theirs) == 3
        for number, (received, turn) in enumerate(zip(theirs, talk.turns, strict=True)):
            messages = received.body["messages"]
            assert len(messages) == 2 * number + 1  # the history grows by a user + a reply
            assert [m["role"] for m in messages] == ["user", "assistant"] * number + ["user"]
            assert messages[-1]["content"] == turn.message
            if number:
                before = theirs[number - 1]
                # The whole previous request, then the reply the fake streamed to it.
                assert messages[:-2] == before.body["messages"]
                assert messages[-2] == {"role": "assistant", "content": before.reply}
                # Sent only after that reply ended, and the user's think time on top.
                assert turn.think_s >= 0.1
                assert received.arrived >= before.finished + turn.think_s - 0.01
        mine = sorted((r for r in records if r.conversation == index), key=lambda r: r.turn)
        assert [r.turn for r in mine] == [0, 1, 2]
    assert duration >= 2 * 0.1


def test_a_first_message_length_applies_to_turn_zero_only():
    talks = conversation.conversations(
        3, 3, Length.parse("4"), Length.parse("2"), 0.0, PromptText(0), Length.parse("40")
    )
    for talk in talks:
        assert [turn.message_tokens for turn in talk.turns] == [40, 4, 4]


def test_records_carry_the_infinite_cache_bound_and_the_servers_hits(fake):
    talk = Conversation([Turn("a b c", 3, 2, 0.0), Turn("d e", 2, 2, 0.0), Turn("f", 1, 2, 0.0)])
    records, _ = hold(fake, [talk])
    # The fake counts one token per word: prompts of 3, 3+2+2 = 7 and 7+2+1 = 10 tokens.
    assert [r.input_tokens for r in records] == [3, 7, 10]
    # Infinite cache: the previous prompt and its reply but the reply's last token.
    assert [r.cacheable_tokens for r in records] == [0, 3 + 2 - 1, 7 + 2 - 1]
    # The fake caches prompts only: each turn hits the previous prompt.
    assert [r.cached_tokens for r in records] == [0, 3, 7]
    # The workload's own count follows the history: messages plus the replies' tokens.
    assert [r.prompt_tokens for r in records] == [3, 7, 10]


def test_a_failed_turn_ends_its_conversation(fake):
    talk = Conversation(
        [Turn("fine", 1, 2, 0.0), Turn("http-error", 1, 2, 0.0), Turn("x", 1, 2, 0.0)]
    )
    records, _ = hold(fake, [talk])
    assert [(r.turn, r.ok) for r in records] == [(0, True), (1, False)]
    assert "HTTP 503" in records[1].error


def test_no_turn_starts_past_the_deadline(fake):
    talk = Conversation([Turn("a", 1, 2, 0.0), Turn("b", 1, 2, 5.0)])
    records, duration = hold(fake, [talk], max_duration=1.0)
    assert [r.turn for r in records] == [0]
    assert duration < 3.0  # it did not sit out the 5 s think time


def test_closed_loop_holds_n_conversations_at_a_time(fake):
    talks = [Conversation([Turn(f"c{i}", 1, 2, 0.0), Turn("more", 1, 2, 0.0)]) for i in range(3)]
    records, _ = hold(fake, talks, offsets=None, concurrency=1)
    assert fake.max_in_flight == 1
    # One conversation at a time: each one's turns come before the next one's.
    assert [(r.conversation, r.turn) for r in records] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_command_prints_turns_and_writes_them(fake, tmp_path, capsys):
    args = bench_args(
        "--url",
        fake.url,
        "--workload",
        "conversation",
        "--conversations",
        "3",
        "--turns",
        "2",
        "--think-time",
        "0",
        "--input-len",
        "4",
        "--output-len",
        "3",
        "--warmup",
        "1",
        "--no-progress",
        "--output-json",
        str(tmp_path / "bench.json"),
    )
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "Prefix cache hit rate:" in out and "Infinite-cache hit rate (bound):" in out
    assert "TTFT p50 (ms)" in out

    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["config"]["endpoint"] == "chat"  # the conversation workload's default
    requests = document["requests"]
    assert sorted(r["turn"] for r in requests) == [0, 0, 0, 1, 1, 1]
    assert sorted(r["conversation"] for r in requests) == [0, 0, 1, 1, 2, 2]
    assert all("output_text" not in r for r in requests)
    # The warm-up shared nothing with the conversations: turn 0 hits nothing.
    assert all(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for r in requests
        if r["turn"] == 0
    )
    turns = document["summary"]["turns"]
    assert [(t["turn"], t["requests"], t["ttft"]["count"]) for t in turns] == [(0, 3, 3), (1, 3, 3)]
    assert turns[0]["prefix_hit_rate"] == 0 and turns[0]["infinite_cache_hit_rate"] == 0
    # Turn 1: 4 words + a 3-token reply + 4 words; the fake held the first 4, the bound 4 + 3 - 1.
    assert turns[1]["prefix_hit_rate"] == pytest.approx(4 / 11)
    assert turns[1]["infinite_cache_hit_rate"] == pytest.approx(6 / 11)
    assert document["summary"]["infinite_cache_hit_rate"] == pytest.approx(18 / (3 * 4 + 3 * 11))


def test_a_server_that_does_not_report_cached_tokens_is_named(tmp_path, capsys):
    server = FakeOpenAIServer(report_cached=False, ttft_s=0.02, itl_s=0.01).start()
    try:
        args = bench_args(
            "--url", server.url, "--workload", "conversation", "--conversations", "1", "--turns",
            "2", "--think-time", "0", "--warmup", "0", "--no-progress", "--output-len", "2",
            "--output-json", str(tmp_path / "bench.json"),
        )  # fmt: skip
        assert args.run(args) == 0
    finally:
        server.stop()
    assert (
        "Prefix cache hit rate:               not reported by the server" in capsys.readouterr().out
    )
    summary = json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert summary["prefix_hit_rate"] is None and summary["turns"][1]["prefix_hit_rate"] is None
    assert summary["infinite_cache_hit_rate"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--turns", "0"], "--turns must be at least 1"),
        (["--conversations", "0"], "--conversations must be at least 1"),
        (["--think-time", "-1"], "--think-time must be 0 or more"),
        (["--endpoint", "completions"], "use --endpoint chat"),
        (["--num-requests", "5"], "leave out --num-requests"),
        (["--first-input-len", "0"], "bad length '0'"),
    ],
)
def test_bad_conversation_options_exit_2(argv, message, capsys):
    args = bench_args("--url", "http://127.0.0.1:9", "--workload", "conversation", *argv)
    assert args.run(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("pdserve bench: error:") and message in error


def test_a_first_message_length_needs_the_conversation_workload(capsys):
    args = bench_args("--url", "http://127.0.0.1:9", "--first-input-len", "512")
    assert args.run(args) == 2
    assert "--first-input-len goes with --workload conversation" in capsys.readouterr().err


def test_the_sweep_refuses_the_conversation_workload(capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    sweep_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["sweep", "--rates", "1", "--slo", "ttft=1s", "--workload", "conversation"]
    )
    assert args.run(args) == 2
    assert "runs in pdserve bench" in capsys.readouterr().err
