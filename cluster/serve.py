"""`pdserve serve`: the whole cluster on one host, with no Redis and no Ray.

Starts the workers as child processes, waits until their engines are ready, then runs the
router in this process. Ctrl-C or SIGTERM stops the router and every child it started.
"""

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from cluster.console import say
from cluster import engine as engine_factory
from cluster.model_store import ModelError, resolve_model
from cluster.worker_process import start_worker, stop_worker, wait_ready
from router.command import add_router_arguments, router_config, run_router


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI API with the router and local workers",
        description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1, metavar="N",
                        help="prefill workers (default: 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="M",
                        help="decode workers (default: 1)")
    parser.add_argument("--colocated", action="store_true",
                        help="no disaggregation: --workers colocated workers instead")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --colocated: number of colocated workers (default: 1)")
    parser.add_argument("--kv-failure-policy", choices=("recompute", "fail"), default="recompute",
                        help="when KV does not arrive in time: the decode worker prefills the "
                             "prompt itself, or the request fails (default: recompute)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where worker logs go (default: a new temporary folder)")
    add_router_arguments(parser)
    engine_factory.add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.colocated and (args.decode < 1 or args.prefill < 0):
        print("pdserve serve: need --decode >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)
        _check_port_free(args.host, args.port)
    except (ModelError, OSError) as error:
        print(f"pdserve serve: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"worker logs: {log_dir}")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    workers = []
    plan = _worker_plan(args)
    threads = max(1, (os.cpu_count() or 1) // sum(count for _, count, _ in plan))
    try:
        for role, count, extra in plan:
            for _ in range(count):
                workers.append(start_worker(role, engine_factory.engine_argv(args) + extra,
                                            log_dir, threads))
        wait_ready(workers, args.worker_ready_timeout, progress=say)
        asyncio.run(run_router(args, router_config(args, model,
                                                   worker_addresses=[w.address for w in workers])))
        return 0
    except RuntimeError as error:
        say(f"pdserve serve: {error}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if workers:
            say(f"stopping {len(workers)} worker(s)")
        for worker in workers:
            stop_worker(worker)


def _worker_plan(args) -> list[tuple[str, int, list[str]]]:
    """(role, count, extra worker arguments) for each pool."""
    if args.colocated:
        return [("colocated", args.workers, [])]
    return [("prefill", args.prefill, []),
            ("decode", args.decode, ["--kv-failure-policy", args.kv_failure_policy])]


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
