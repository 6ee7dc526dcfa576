"""Options shared by `pdserve bench` and `pdserve sweep`: what to send (model, endpoint, workload),
how to judge it (SLO, timeout), and turning them into the list of requests."""

import argparse
from pathlib import Path

from pdserve.bench import workload
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
        default="completions",
        help="/v1/completions with a prompt, or /v1/chat/completions with messages "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"requests to send (default: {DEFAULT_NUM_REQUESTS}; for a trace, all its lines, "
        "or its first N)",
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
        choices=("synthetic", "shared-prefix", "mixed", "trace"),
        default="synthetic",
        help="synthetic lengths; shared prefixes + own suffixes; a fraction of long prompts among "
        "short ones; or replay of a JSONL trace (default: %(default)s)",
    )
    work.add_argument(
        "--input-len",
        metavar="DIST",
        help="prompt tokens: N, LOW-HIGH (uniform) or normal:MEAN,STD; for shared-prefix the "
        "suffix, for mixed the short prompts (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_INPUT_LEN.items())
        + ")",
    )
    work.add_argument(
        "--output-len",
        default="128",
        metavar="DIST",
        help="max_tokens per request, same forms as --input-len (default: %(default)s)",
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
        "--trace",
        type=Path,
        metavar="FILE",
        help='with --workload trace: JSONL, one {"prompt" or "messages", "max_tokens", optional '
        '"timestamp" (send offset, s)} per line',
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
        "(keys ttft, tpot, e2e; a bare number is seconds)",
    )
    out.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request still unfinished after this counts as failed (default: %(default)s)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return out


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse option values argparse lets through; options a command lacks are skipped."""
    for name in ("num_requests", "concurrency", "num_prefixes", "prefix_len"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("request_rate", "burstiness", "max_duration", "timeout"):
        if getattr(args, name, None) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        raise ValueError("--warmup must be 0 or more")
    if (args.workload == "trace") != (args.trace is not None):
        raise ValueError("--trace FILE goes with --workload trace, and only with it")


def build_requests(args: argparse.Namespace) -> list[workload.BenchRequest]:
    tokenizer = workload.load_tokenizer(args.tokenizer) if args.tokenizer else None
    text = workload.PromptText(args.seed, tokenizer)
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
