"""Options shared by `pdserve bench` and `pdserve sweep`: what to send (model, endpoint, workload),
how to judge it (SLO, timeout), and turning them into the list of requests (or conversations)."""

import argparse
from pathlib import Path

from pdserve.bench import mooncake_trace, presets, workload
from pdserve.bench.conversation import Conversation, conversations
from pdserve.bench.infinite_cache import mark_cacheable
from pdserve.bench.mooncake_trace import DEFAULT_BLOCK_SIZE
from pdserve.bench.workload import DEFAULT_INPUT_LEN

DEFAULT_NUM_REQUESTS = 100
DEFAULT_WARMUP = 4


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """What to send and how to judge it, shared with `pdserve sweep`; returns the
    "measurement and output" group for the caller's own outputs."""
    parser.add_argument(
        "--model", help="model name to request (default: the first one at URL/v1/models)"
    )
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        help="/v1/completions with a prompt, or /v1/chat/completions with messages "
        "(default: chat for the conversation workload, else completions)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"requests to send (default: {DEFAULT_NUM_REQUESTS}; for a trace, all its lines, "
        "or its first N; a conversation workload sends --conversations x --turns)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        metavar="N",
        help="requests sent first, two at a time, and not counted: a fresh vLLM engine on CPU "
        "answered its first requests several times slower (default: %(default)s; 0: none)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        metavar="B",
        help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular "
        "(default: %(default)s)",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        choices=("synthetic", "shared-prefix", "mixed", "conversation", "trace", *presets.PRESETS),
        default="synthetic",
        help="synthetic lengths; shared prefixes + own suffixes; a fraction of long prompts among "
        "short ones; multi-turn chats resending their history; replay of a trace; or a named "
        "one, its options' values preset (an option given wins): "
        + "; ".join(f"{name}: {p.summary}" for name, p in presets.PRESETS.items())
        + " (default: %(default)s)",
    )
    work.add_argument(
        "--input-len",
        metavar="DIST",
        help="prompt tokens: N, LOW-HIGH (uniform) or normal:MEAN,STD; for shared-prefix the "
        "suffix, for mixed the short prompts, for conversation each turn's new user message "
        "(default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_INPUT_LEN.items()) + ")",
    )
    work.add_argument(
        "--output-len",
        metavar="DIST",
        help="max_tokens per request, same forms as --input-len "
        f"(default: {presets.GENERIC_DEFAULTS['output_len']})",
    )
    work.add_argument(
        "--num-prefixes",
        type=int,
        default=4,
        metavar="N",
        help="shared-prefix: distinct prefixes (default: %(default)s)",
    )
    work.add_argument(
        "--prefix-len",
        type=int,
        default=512,
        metavar="TOKENS",
        help="shared-prefix: tokens per prefix (default: %(default)s)",
    )
    work.add_argument(
        "--long-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="mixed: fraction of long prompts (default: %(default)s)",
    )
    work.add_argument(
        "--long-input-len",
        default="normal:1500,150",
        metavar="DIST",
        help="mixed: tokens of a long prompt (default: %(default)s)",
    )
    work.add_argument(
        "--conversations",
        type=int,
        metavar="N",
        help="conversation: conversations, held side by side "
        f"(default: {presets.GENERIC_DEFAULTS['conversations']})",
    )
    work.add_argument(
        "--turns",
        type=int,
        metavar="T",
        help="conversation: turns per conversation, each resending the history and the model's "
        f"replies plus a new user message (default: {presets.GENERIC_DEFAULTS['turns']})",
    )
    work.add_argument(
        "--first-input-len",
        metavar="DIST",
        help="conversation: tokens of each conversation's first user message (a document or "
        "code the chat is about, resent by every later turn), same forms as --input-len "
        "(default: as --input-len)",
    )
    work.add_argument(
        "--think-time",
        type=float,
        metavar="SECONDS",
        help="conversation: mean pause between a reply and the next turn, uniform in 0.5-1.5 "
        f"times it (default: {presets.GENERIC_DEFAULTS['think_time']})",
    )
    work.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="with --workload trace: the trace file (see --trace-format)",
    )
    work.add_argument(
        "--trace-format",
        choices=("jsonl", "mooncake"),
        default="jsonl",
        help='jsonl: one {"prompt" or "messages", "max_tokens", optional "timestamp" (send '
        'offset, s)} per line; mooncake: one {"timestamp" (ms), "input_length", '
        '"output_length", "hash_ids"} per line, equal hash ids being equal token blocks '
        "(default: %(default)s)",
    )
    work.add_argument(
        "--trace-block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="TOKENS",
        help="mooncake: tokens per hash id (default: %(default)s, as in Mooncake's traces)",
    )
    work.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help="size prompts exactly with this model folder's tokenizer "
        "(default: about 1 token per word)",
    )
    work.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server (vLLM) to generate exactly max_tokens",
    )
    work.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for prompts, lengths and arrival times (default: %(default)s)",
    )

    out = parser.add_argument_group("measurement and output")
    out.add_argument(
        "--slo",
        metavar="OBJECTIVES",
        help='goodput objectives, e.g. "ttft=500ms,tpot=50ms" '
        "(keys ttft, tpot, e2e; a bare number is seconds; default: a named workload's own, "
        "else none)",
    )
    out.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request still unfinished after this counts as failed (default: %(default)s)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return out


def check_arguments(args: argparse.Namespace) -> None:
    """Resolve a named workload (bench.presets), refuse option values argparse lets through
    (options a command lacks are skipped), and set the endpoint's per-workload default."""
    presets.resolve(args)
    for name in (
        "num_requests",
        "concurrency",
        "num_prefixes",
        "prefix_len",
        "conversations",
        "turns",
        "trace_block_size",
    ):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("request_rate", "burstiness", "max_duration", "timeout"):
        if getattr(args, name, None) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for name in ("warmup", "think_time"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or more")
    if (args.workload == "trace") != (args.trace is not None):
        raise ValueError("--trace FILE goes with --workload trace, and only with it")
    if args.trace_format != "jsonl" and args.workload != "trace":
        raise ValueError("--trace-format goes with --workload trace")
    if args.first_input_len is not None and args.workload != "conversation":
        raise ValueError("--first-input-len goes with --workload conversation")
    if args.workload == "conversation":
        if args.endpoint == "completions":
            raise ValueError(
                "--workload conversation sends chat messages: use --endpoint chat (its default)"
            )
        if args.num_requests is not None:
            raise ValueError(
                "--workload conversation sends --conversations x --turns requests: "
                "leave out --num-requests"
            )
    args.endpoint = args.endpoint or ("chat" if args.workload == "conversation" else "completions")


def _prompt_text(args: argparse.Namespace) -> workload.PromptText:
    tokenizer = workload.load_tokenizer(args.tokenizer) if args.tokenizer else None
    return workload.PromptText(args.seed, tokenizer)


def build_requests(args: argparse.Namespace) -> list[workload.BenchRequest]:
    """The requests, with their infinite-cache bound where the workload knows it (assuming the
    first --warmup of them were sent once before, as `pdserve bench` does)."""
    requests = _requests(args, _prompt_text(args))
    mark_cacheable(requests, args.warmup)
    return requests


def build_conversations(
    args: argparse.Namespace,
) -> tuple[list[Conversation], list[workload.BenchRequest]]:
    """The conversations, and warm-up requests that share no text with them."""
    text = _prompt_text(args)
    message_len = workload.Length.parse(args.input_len or DEFAULT_INPUT_LEN[args.workload])
    output_len = workload.Length.parse(args.output_len)
    first_len = workload.Length.parse(args.first_input_len) if args.first_input_len else None
    talks = conversations(
        args.conversations, args.turns, message_len, output_len, args.think_time, text, first_len
    )
    return talks, workload.synthetic(args.warmup, message_len, output_len, text)


def _requests(args: argparse.Namespace, text: workload.PromptText) -> list[workload.BenchRequest]:
    if args.workload == "trace" and args.trace_format == "mooncake":
        return mooncake_trace.trace(args.trace, args.trace_block_size, text, args.num_requests)
    if args.workload == "trace":
        requests = workload.trace(args.trace, text)[: args.num_requests]
        if args.endpoint == "completions" and any(r.messages is not None for r in requests):
            raise ValueError(f"{args.trace} has chat 'messages': use --endpoint chat")
        return requests
    n = args.num_requests or DEFAULT_NUM_REQUESTS
    input_len = workload.Length.parse(args.input_len or DEFAULT_INPUT_LEN[args.workload])
    output_len = workload.Length.parse(args.output_len)
    if args.workload == "shared-prefix":
        return workload.shared_prefix(
            n, args.num_prefixes, args.prefix_len, input_len, output_len, text
        )
    if args.workload == "mixed":
        long_len = workload.Length.parse(args.long_input_len)
        return workload.mixed(n, args.long_fraction, input_len, long_len, output_len, text)
    return workload.synthetic(n, input_len, output_len, text)
