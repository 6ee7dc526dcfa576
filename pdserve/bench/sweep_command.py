"""`pdserve sweep`: for each prefill:decode ratio, start the cluster, benchmark it at each
request rate, and report goodput per worker (table, JSON, PNG), marking the best ratio.

Each ratio is a fresh `pdserve serve --prefill N --decode M` on this host
(bench.local_cluster); with `--flex`, one `pdserve serve --flex N` runs the whole sweep and
each ratio is a role change (`POST /pdserve/roles`; the flex workers a ratio leaves out stand
by), so the sweep costs one engine start per worker.
"""

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Target, first_model, make_http_client
from pdserve.bench.local_cluster import ClusterStartError, local_cluster
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.options import add_benchmark_arguments, build_requests, check_arguments
from pdserve.bench.report import plot_sweep
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.sweep import Ratio, SweepPoint, sweep_table, write_sweep_json
from pdserve.bench.workload import BenchRequest
from pdserve.protocol.router_admin import API_KEY_ENV, ask_roles
from pdserve.settings.base import ConfigError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="benchmark several prefill:decode ratios at several request rates",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--ratios",
        default="1:1,2:1,1:2",
        metavar="P:D,...",
        help="prefill:decode worker counts to compare (default: %(default)s)",
    )
    parser.add_argument(
        "--rates",
        required=True,
        metavar="RATE,...",
        help="request rates (req/s) to benchmark each ratio at, e.g. 0.5,1,2",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help='more options for every `pdserve serve`, e.g. "--model tiny --kv-cache-gib 1"',
    )
    parser.add_argument(
        "--flex",
        action="store_true",
        help="one cluster of flex workers (as many as the largest ratio) for the whole sweep, "
        "the ratios set by role changes instead of cluster restarts",
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="router port of the clusters (default: %(default)s)"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a cluster may take to start (default: %(default)s)",
    )
    out = add_benchmark_arguments(parser)
    out.add_argument(
        "--output-dir",
        type=Path,
        default=Path("sweep"),
        metavar="DIR",
        help="where sweep.json, goodput_per_worker.png and the cluster logs go "
        "(default: %(default)s)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every ratio ran; 1 when a cluster did not start; 2 on bad input."""
    try:
        check_arguments(args)
        if args.slo is None:
            raise ValueError(
                "--slo is required: the sweep compares goodput, e.g. --slo ttft=2s,tpot=200ms"
            )
        if args.workload == "conversation":
            raise ValueError(
                f"--workload {args.preset or 'conversation'} runs in pdserve bench: a sweep "
                "sends one list of requests at each rate"
            )
        slo = Slo.parse(args.slo)
        ratios = Ratio.parse_list(args.ratios)
        rates = [_rate(text) for text in args.rates.split(",")]
        requests = build_requests(args)
    except (ValueError, OSError) as error:
        print(f"pdserve sweep: error: {error}", file=sys.stderr)
        return 2
    points: list[SweepPoint] = []
    try:
        if args.flex:
            _flex_sweep(args, ratios, rates, requests, slo, points)
        else:
            for number, ratio in enumerate(ratios, start=1):
                log_dir = args.output_dir / f"logs-{ratio.prefill}p{ratio.decode}d"
                _say(
                    f"ratio {ratio.label} ({number}/{len(ratios)}): starting {ratio.prefill} "
                    f"prefill + {ratio.decode} decode worker(s), logs in {log_dir}"
                )
                with local_cluster(
                    ratio.prefill,
                    ratio.decode,
                    args.port,
                    log_dir,
                    shlex.split(args.serve_args),
                    args.ready_timeout,
                ) as url:
                    _run_rates(url, args, ratio, rates, requests, slo, points)
    except ClusterStartError as error:
        print(f"pdserve sweep: {error}", file=sys.stderr)
        return 1
    finally:
        if points:
            _report(args, points, len(requests))
    return 0


def _flex_sweep(args, ratios, rates, requests, slo, points: list[SweepPoint]) -> None:
    workers = max(ratio.workers for ratio in ratios)
    log_dir = args.output_dir / f"logs-flex{workers}"
    _say(f"starting {workers} flex worker(s) for every ratio, logs in {log_dir}")
    with local_cluster(
        0, 0, args.port, log_dir, shlex.split(args.serve_args), args.ready_timeout, flex=workers
    ) as url:
        for number, ratio in enumerate(ratios, start=1):
            took = _set_roles(url, ratio)
            _say(f"ratio {ratio.label} ({number}/{len(ratios)}): roles set in {took * 1e3:.0f} ms")
            _run_rates(url, args, ratio, rates, requests, slo, points)


def _set_roles(url: str, ratio: Ratio) -> float:
    """Give the flex workers the ratio's roles; the seconds the router took."""
    split = {"prefill": ratio.prefill, "decode": ratio.decode}
    try:
        return ask_roles(url, split, os.environ.get(API_KEY_ENV, ""))["seconds"]
    except (ConfigError, RuntimeError) as error:
        raise ClusterStartError(f"could not set ratio {ratio.label}: {error}") from None


def _run_rates(url, args, ratio: Ratio, rates, requests, slo, points: list[SweepPoint]) -> None:
    asyncio.run(_warm_up(url, args, requests))
    for rate in rates:
        _say(f"ratio {ratio.label}: {len(requests)} requests at {rate:g} req/s")
        summary = asyncio.run(_measure(url, args, requests, rate, slo))
        points.append(SweepPoint(ratio, rate, summary))


async def _target(url: str, args: argparse.Namespace) -> Target:
    model = args.model
    if model is None:
        async with make_http_client() as http:
            model = await first_model(http, url)
    return Target(url, model, args.endpoint, args.ignore_eos)


async def _warm_up(url: str, args: argparse.Namespace, requests: list[BenchRequest]) -> None:
    await warm_up(requests, await _target(url, args), args.warmup, args.timeout)


async def _measure(
    url: str, args: argparse.Namespace, requests: list[BenchRequest], rate: float, slo: Slo
):
    offsets = arrival_times(len(requests), rate, args.burstiness, args.seed)
    records, duration = await run_benchmark(
        requests,
        await _target(url, args),
        offsets=offsets,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    return summarize(records, duration, slo)


def _report(args: argparse.Namespace, points: list[SweepPoint], num_requests: int) -> None:
    """Table, JSON and plot of whatever was measured (also after an interruption)."""
    print(sweep_table(points))
    config = {
        "ratios": args.ratios,
        "flex": args.flex,
        "rates": args.rates,
        "serve_args": args.serve_args,
        "slo": args.slo,
        "workload": args.workload,
        "preset": args.preset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_requests": num_requests,
        "seed": args.seed,
        "burstiness": args.burstiness,
    }
    write_sweep_json(args.output_dir / "sweep.json", config, points)
    plot_sweep(args.output_dir / "goodput_per_worker.png", points, args.slo)
    _say(f"wrote {args.output_dir / 'sweep.json'} and {args.output_dir / 'goodput_per_worker.png'}")


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not 0 < rate < float("inf"):
        raise ValueError(f"bad rate {text!r}: expected a positive number of requests/s")
    return rate


def _say(message: str) -> None:
    print(f"[sweep] {message}", file=sys.stderr, flush=True)
