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
import time
from pathlib import Path

from cluster import engine as engine_factory
from cluster.model_store import ModelError, resolve_model
from cluster.worker_process import start_worker, stop_worker, wait_ready
from router.disaggregation import ADMISSIONS, AFTER_PREFILL
from router.policies import POLICIES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI API with the router and local workers",
        description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="router bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    parser.add_argument("--prefill", type=int, default=1, metavar="N",
                        help="prefill workers (default: 1)")
    parser.add_argument("--decode", type=int, default=1, metavar="M",
                        help="decode workers (default: 1)")
    parser.add_argument("--colocated", action="store_true",
                        help="no disaggregation: --workers colocated workers instead")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --colocated: number of colocated workers (default: 1)")
    parser.add_argument("--disaggregate-min-tokens", type=int, default=256, metavar="TOKENS",
                        help="prompts shorter than this go straight to a decode worker, which "
                             "prefills them itself (default: 256)")
    parser.add_argument("--kv-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long a decode worker waits for a prompt's KV (default: 30)")
    parser.add_argument("--kv-failure-policy", choices=("recompute", "fail"), default="recompute",
                        help="when KV does not arrive in time: the decode worker prefills the "
                             "prompt itself, or the request fails (default: recompute)")
    parser.add_argument("--decode-admission", choices=ADMISSIONS, default=AFTER_PREFILL,
                        help="when a decode worker hears of a disaggregated request: with-prefill "
                             "(reserves KV blocks while the prompt computes; its engine polls "
                             "for the KV meanwhile, which slowed a prefill worker sharing its "
                             "CPU cores by ~25%%) or after-prefill (default)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="round-robin",
                        help="how a worker is chosen within a pool (default: round-robin)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients send (default: the --model value)")
    parser.add_argument("--default-max-tokens", type=int, default=512,
                        help="max_tokens when a request gives none (default: 512)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may take on a worker (default: 600)")
    parser.add_argument("--worker-ready-timeout", type=float, default=600.0,
                        help="seconds to wait for workers to load the model (default: 600)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where worker logs go (default: a new temporary folder)")
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
        asyncio.run(_run_router(args, model, [w.address for w in workers]))
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


async def _run_router(args, model: Path, addresses: list[str]) -> None:
    import uvicorn

    from router.app import RouterConfig, create_app

    config = RouterConfig(
        served_model=args.served_model_name or args.model, model_dir=model,
        worker_addresses=addresses, default_max_tokens=args.default_max_tokens,
        request_timeout_s=args.request_timeout, worker_ready_timeout_s=args.worker_ready_timeout,
        disaggregate_min_tokens=args.disaggregate_min_tokens, kv_timeout_s=args.kv_timeout,
        policy=args.policy, decode_admission=args.decode_admission)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=args.host, port=args.port,
                                           log_level="warning"))
    announce = asyncio.create_task(_announce_when_started(server, args, config.served_model))
    try:
        await server.serve()
    finally:
        announce.cancel()


async def _announce_when_started(server, args, served_model: str) -> None:
    started = time.monotonic()
    while not server.started:
        if time.monotonic() - started > 60:
            return
        await asyncio.sleep(0.1)
    url = f"http://{args.host}:{args.port}"
    say(f"pdserve ready at {url}/v1 (model: {served_model})\n"
        f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"model\": \"{served_model}\", \"messages\": "
        f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
