"""The `pdserve bench` sub-command: benchmark an OpenAI-compatible server (the pdserve router,
or any other) with streamed requests, and report TTFT, TPOT, ITL, E2E, throughput and goodput."""

import argparse
import asyncio
import math
import sys
from pathlib import Path

from pdserve.bench import conversation
from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Target, first_model, make_http_client
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.options import (
    add_benchmark_arguments,
    build_conversations,
    build_requests,
    check_arguments,
)
from pdserve.bench.report import plot_cdfs, table, write_json
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.workload import BenchRequest


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark a running server with streamed requests", description=__doc__
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    load = parser.add_argument_group("load: open loop at a rate, or closed loop at a concurrency")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--request-rate",
        type=float,
        metavar="RATE",
        help="open loop: mean requests/s (conversation: conversations started/s), 'inf' sends "
        "all at once (default: inf, or a trace's own timestamps when it has them)",
    )
    mode.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="closed loop: keep N requests (conversation: conversations) in flight",
    )
    load.add_argument(
        "--max-duration",
        type=float,
        metavar="SECONDS",
        help="send nothing new after this; requests still running then count as failed "
        "(default: no limit)",
    )
    out = add_benchmark_arguments(parser)
    out.add_argument(
        "--output-json",
        type=Path,
        metavar="FILE",
        help="write config, summary and every request here",
    )
    out.add_argument(
        "--plot-dir",
        type=Path,
        metavar="DIR",
        help="write latency_cdf.png (TTFT, TPOT, ITL, E2E CDFs) in DIR",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when the benchmark ran and a request succeeded; 1 when none did, or when
    the model could not be asked from the server; 2 on bad input."""
    try:
        check_arguments(args)
        slo = Slo.parse(args.slo) if args.slo else None
        if args.workload == "conversation":
            talks, requests = build_conversations(args)  # requests: the warm-up's only
            offsets = _offsets(args, len(talks), None)
        else:
            talks, requests = None, build_requests(args)
            timestamps = [r.timestamp for r in requests]
            offsets = _offsets(args, len(requests), None if None in timestamps else timestamps)
    except (ValueError, OSError) as error:
        print(f"pdserve bench: error: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_bench(args, requests, talks, offsets, slo))


def _offsets(
    args: argparse.Namespace, count: int, timestamps: list[float] | None
) -> list[float] | None:
    """Start times of the `count` requests (or conversations) for the open loop; None for the
    closed loop."""
    if args.concurrency is not None:
        return None
    if args.request_rate is None and timestamps is not None:
        return timestamps  # a trace with timestamps replays its own timing
    rate = math.inf if args.request_rate is None else args.request_rate
    return arrival_times(count, rate, args.burstiness, args.seed)


async def _bench(
    args,
    requests: list[BenchRequest],
    talks: list[conversation.Conversation] | None,
    offsets: list[float] | None,
    slo: Slo | None,
) -> int:
    model = args.model
    if model is None:
        try:
            async with make_http_client() as http:
                model = await first_model(http, args.url)
        except Exception as error:
            print(
                f"pdserve bench: error: cannot get the model from {args.url}/v1/models: {error}",
                file=sys.stderr,
            )
            return 1
    target = Target(args.url, model, args.endpoint, args.ignore_eos)
    await warm_up(requests, target, args.warmup, args.timeout)
    schedule = {
        "offsets": offsets,
        "concurrency": args.concurrency,
        "timeout": args.timeout,
        "max_duration": args.max_duration,
        "progress": not args.no_progress,
    }
    if talks is None:
        records, duration = await run_benchmark(requests, target, **schedule)
    else:
        records, duration = await conversation.run(talks, target, **schedule)
    summary = summarize(records, duration, slo)
    print(table(summary, records))
    if args.output_json:
        config = {k: v for k, v in vars(args).items() if k not in ("run", "command")} | {
            "model": model
        }
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
