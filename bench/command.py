"""The `pdserve bench` sub-command: benchmark an OpenAI-compatible server (the pdserve router,
or any other) with streamed requests, and report TTFT, TPOT, ITL, E2E, throughput and goodput."""

import argparse
import asyncio
import math
import sys
from pathlib import Path

from bench import workload
from bench.workload import DEFAULT_INPUT_LEN
from bench.arrivals import arrival_times
from bench.client import Target, first_model, make_http_client
from bench.metrics import Slo, summarize
from bench.report import plot_cdfs, table, write_json
from bench.runner import run as run_benchmark

DEFAULT_NUM_REQUESTS = 100


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark a running server with streamed requests", description=__doc__
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first one at URL/v1/models)")
    parser.add_argument(
        "--endpoint", choices=("completions", "chat"), default="completions",
        help="/v1/completions with a prompt, or /v1/chat/completions with messages (default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests", type=int, metavar="N",
        help=f"requests to send (default: {DEFAULT_NUM_REQUESTS}; for a trace, all its lines, or its first N)",
    )

    load = parser.add_argument_group("load: open loop at a rate, or closed loop at a concurrency")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate", type=float, metavar="RATE",
        help="open loop: mean requests/s, 'inf' sends all at once (default: inf, "
        "or a trace's own timestamps when it has them)",
    )
    mode.add_argument("--concurrency", type=int, metavar="N", help="closed loop: keep N requests in flight")
    load.add_argument(
        "--burstiness", type=float, default=1.0, metavar="B",
        help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular "
        "(default: %(default)s)",
    )
    load.add_argument(
        "--max-duration", type=float, metavar="SECONDS",
        help="send nothing new after this; requests still running then count as failed (default: no limit)",
    )

    add_workload_arguments(parser)

    out = parser.add_argument_group("measurement and output")
    out.add_argument(
        "--slo", metavar="OBJECTIVES",
        help='goodput objectives, e.g. "ttft=500ms,tpot=50ms" (keys ttft, tpot, e2e; a bare number is seconds)',
    )
    out.add_argument(
        "--timeout", type=float, default=600.0, metavar="SECONDS",
        help="a request still unfinished after this counts as failed (default: %(default)s)",
    )
    out.add_argument("--output-json", type=Path, metavar="FILE", help="write config, summary and every request here")
    out.add_argument(
        "--plot-dir", type=Path, metavar="DIR", help="write latency_cdf.png (TTFT, TPOT, ITL, E2E CDFs) in DIR"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(run=run)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options, shared with `pdserve sweep`."""
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload", choices=("synthetic", "shared-prefix", "mixed", "trace"), default="synthetic",
        help="synthetic lengths; shared prefixes + own suffixes; a fraction of long prompts among "
        "short ones; or replay of a JSONL trace (default: %(default)s)",
    )
    work.add_argument(
        "--input-len", metavar="DIST",
        help="prompt tokens: N, LOW-HIGH (uniform) or normal:MEAN,STD; for shared-prefix the suffix, "
        "for mixed the short prompts (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_INPUT_LEN.items()) + ")",
    )
    work.add_argument(
        "--output-len", default="128", metavar="DIST",
        help="max_tokens per request, same forms as --input-len (default: %(default)s)",
    )
    work.add_argument(
        "--num-prefixes", type=int, default=4, metavar="N", help="shared-prefix: distinct prefixes (default: %(default)s)"
    )
    work.add_argument(
        "--prefix-len", type=int, default=512, metavar="TOKENS", help="shared-prefix: tokens per prefix (default: %(default)s)"
    )
    work.add_argument(
        "--long-fraction", type=float, default=0.1, metavar="F", help="mixed: fraction of long prompts (default: %(default)s)"
    )
    work.add_argument(
        "--long-input-len", default="normal:1500,150", metavar="DIST",
        help="mixed: tokens of a long prompt (default: %(default)s)",
    )
    work.add_argument(
        "--trace", type=Path, metavar="FILE",
        help='with --workload trace: JSONL, one {"prompt" or "messages", "max_tokens", optional '
        '"timestamp" (send offset, s)} per line',
    )
    work.add_argument(
        "--tokenizer", metavar="MODEL_DIR",
        help="size prompts exactly with this model folder's tokenizer (default: about 1 token per word)",
    )
    work.add_argument("--ignore-eos", action="store_true", help="ask the server (vLLM) to generate exactly max_tokens")
    work.add_argument(
        "--seed", type=int, default=0, help="seed for prompts, lengths and arrival times (default: %(default)s)"
    )



def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when the benchmark ran and a request succeeded; 1 when none did, or when
    the model could not be asked from the server; 2 on bad input."""
    try:
        _check(args)
        slo = Slo.parse(args.slo) if args.slo else None
        requests = build_requests(args)
        offsets = _offsets(args, requests)
    except (ValueError, OSError) as error:
        print(f"pdserve bench: error: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_bench(args, requests, offsets, slo))


def _check(args: argparse.Namespace) -> None:
    for name in ("num_requests", "concurrency", "num_prefixes", "prefix_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("request_rate", "burstiness", "max_duration", "timeout"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
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
        return workload.shared_prefix(n, args.num_prefixes, args.prefix_len, input_len, output_len, text)
    if args.workload == "mixed":
        long_len = workload.Length.parse(args.long_input_len)
        return workload.mixed(n, args.long_fraction, input_len, long_len, output_len, text)
    return workload.synthetic(n, input_len, output_len, text)


def _offsets(args: argparse.Namespace, requests: list[workload.BenchRequest]) -> list[float] | None:
    """Send times for the open loop; None for the closed loop."""
    if args.concurrency is not None:
        return None
    if args.request_rate is None and requests[0].timestamp is not None:
        return [r.timestamp for r in requests]  # a trace with timestamps replays its own timing
    rate = math.inf if args.request_rate is None else args.request_rate
    return arrival_times(len(requests), rate, args.burstiness, args.seed)


async def _bench(args, requests, offsets, slo) -> int:
    model = args.model
    if model is None:
        try:
            async with make_http_client() as http:
                model = await first_model(http, args.url)
        except Exception as error:
            print(f"pdserve bench: error: cannot get the model from {args.url}/v1/models: {error}", file=sys.stderr)
            return 1
    target = Target(args.url, model, args.endpoint, args.ignore_eos)
    records, duration = await run_benchmark(
        requests, target, offsets=offsets, concurrency=args.concurrency,
        timeout=args.timeout, max_duration=args.max_duration, progress=not args.no_progress,
    )
    summary = summarize(records, duration, slo)
    print(table(summary, records))
    if args.output_json:
        config = {k: v for k, v in vars(args).items() if k not in ("run", "command")} | {"model": model}
        write_json(args.output_json, _jsonable(config), summary, records)
    if args.plot_dir:
        plot_cdfs(args.plot_dir / "latency_cdf.png", records)
    return 0 if summary.completed else 1


def _jsonable(config: dict) -> dict:
    """Paths as strings, infinite floats as "inf" (JSON has no infinity)."""
    def convert(value):
        if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
            return str(value)
        return value

    return {key: convert(value) for key, value in config.items()}
