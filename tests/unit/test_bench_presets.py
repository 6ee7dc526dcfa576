"""The named workloads of `pdserve bench` (bench.presets): each runs as an existing generator with
its own option values, an option given on the command line wins, the other workloads keep their
generic defaults, and scripts/compare_vllm.py builds the same requests through bench's options."""

import argparse
import importlib.util
from pathlib import Path

import pytest

from pdserve.bench import command, sweep_command
from pdserve.bench.options import build_conversations, build_requests, check_arguments

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--url", "http://127.0.0.1:9", *argv])
    check_arguments(args)
    return args


def test_long_prompt_is_synthetic_with_long_unique_prompts_and_short_answers():
    args = bench_args("--workload", "long-prompt", "--num-requests", "6")
    assert (args.workload, args.preset) == ("synthetic", "long-prompt")
    assert args.endpoint == "completions"
    assert args.slo == "ttft=6s,tpot=100ms"
    requests = build_requests(args)
    assert [(r.prompt_tokens, r.max_tokens) for r in requests] == [(1600, 40)] * 6
    # No reuse: no two prompts start alike (without a tokenizer a word is a token).
    starts = {tuple(r.prompt.split()[:16]) for r in requests}
    assert len(starts) == 6
    assert all(not r.cacheable_tokens for r in requests)


def test_agentic_is_the_conversation_workload_with_a_long_shared_first_message():
    args = bench_args("--workload", "agentic")
    assert (args.workload, args.preset, args.endpoint) == ("conversation", "agentic", "chat")
    assert (args.conversations, args.turns, args.think_time) == (8, 6, 0.5)
    talks, warmups = build_conversations(args)
    assert len(talks) == 8 and len(warmups) == args.warmup
    for talk in talks:
        lengths = [turn.message_tokens for turn in talk.turns]
        assert lengths == [1024] + [64] * 5
        assert all(turn.max_tokens == 32 for turn in talk.turns)
        assert all(0.25 <= turn.think_s <= 0.75 for turn in talk.turns[1:])
    # Every conversation has its own document: high reuse within a chat, none across chats.
    assert len({talk.turns[0].message for talk in talks}) == 8


def test_options_given_win_over_the_preset():
    args = bench_args(
        "--workload", "agentic", "--turns", "3", "--first-input-len", "3000",
        "--output-len", "150", "--think-time", "0", "--slo", "ttft=1s,tpot=50ms",
    )  # fmt: skip
    assert (args.turns, args.first_input_len, args.output_len) == (3, "3000", "150")
    assert (args.think_time, args.slo, args.conversations) == (0, "ttft=1s,tpot=50ms", 8)
    args = bench_args("--workload", "long-prompt", "--input-len", "3000", "--output-len", "150")
    assert (args.input_len, args.output_len) == ("3000", "150")


def test_plain_workloads_keep_their_generic_defaults():
    args = bench_args("--workload", "conversation")
    assert args.preset is None and args.slo is None
    assert (args.conversations, args.turns, args.think_time, args.output_len) == (8, 4, 1.0, "128")
    assert args.first_input_len is None and args.input_len is None
    # Resolving again (a second check) keeps the name of a preset.
    args = bench_args("--workload", "long-prompt")
    check_arguments(args)
    assert (args.workload, args.preset) == ("synthetic", "long-prompt")


def test_a_preset_is_checked_as_its_generator(capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--url", "http://127.0.0.1:9", "--workload", "agentic", "--num-requests", "5"]
    )
    assert args.run(args) == 2
    assert "leave out --num-requests" in capsys.readouterr().err


def test_the_sweep_runs_long_prompt_and_refuses_agentic_by_name(capsys):
    parser = argparse.ArgumentParser(prog="pdserve")
    sweep_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["sweep", "--rates", "1", "--workload", "agentic"])
    assert args.run(args) == 2
    assert "--workload agentic runs in pdserve bench" in capsys.readouterr().err


def load_compare_script():
    spec = importlib.util.spec_from_file_location("compare_vllm", ROOT / "scripts/compare_vllm.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_compare_vllm_builds_each_workload_as_bench_does():
    compare = load_compare_script()
    options = argparse.Namespace(long_fraction=0.1, num_requests=5, output_len=None)
    options.workload = "long-prompt"
    load = compare.workload(options, None, seed=3)
    assert load.talks is None and load.endpoint == "completions"
    assert load.requests == build_requests(
        bench_args("--workload", "long-prompt", "--num-requests", "5", "--seed", "3")
    )
    options.workload = "agentic"  # --num-requests is the conversations per rate
    load = compare.workload(options, None, seed=3)
    assert load.endpoint == "chat" and len(load.talks) == 5 and len(load.requests) == 4
    assert [t.message_tokens for t in load.talks[0].turns] == [1024] + [64] * 5
    options.workload, options.output_len = "mixed", 64
    load = compare.workload(options, None, seed=3)
    assert len(load.requests) == 5 and {r.max_tokens for r in load.requests} == {64}


def test_compare_vllms_default_systems_are_known_and_need_no_extra():
    compare = load_compare_script()
    assert set(compare.DEFAULT_SYSTEMS) <= set(compare.SYSTEMS)
    assert "vllm-nixl" not in compare.DEFAULT_SYSTEMS  # it needs NIXL installed
