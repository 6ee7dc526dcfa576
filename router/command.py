"""`pdserve router`: the router alone, following a cluster's Redis registry (what `pdserve up`
starts), and the router options and start-up that `pdserve serve` shares with it."""

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from cluster.model_store import ModelError, resolve_model
from router.disaggregation import ADMISSIONS, AFTER_PREFILL
from router.policies import POLICIES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router", help="run the router alone, following a Redis registry of workers",
        description=__doc__.splitlines()[0])
    parser.add_argument("--registry", required=True, metavar="REDIS_URL",
                        help="the registry the workers join (redis://host:port/db)")
    parser.add_argument("--cluster", default="pdserve",
                        help="the cluster's name in the registry (default: pdserve)")
    parser.add_argument("--model", default="smollm2",
                        help="where the tokenizer comes from: a `pdserve model` name or a Hugging "
                             "Face folder (default: smollm2)")
    add_router_arguments(parser)
    parser.set_defaults(run=run)


def add_router_arguments(parser) -> None:
    """The options of the router itself, for `pdserve router` and `pdserve serve`."""
    parser.add_argument("--host", default="127.0.0.1", help="router bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    parser.add_argument("--disaggregate-min-tokens", type=int, default=256, metavar="TOKENS",
                        help="prompts shorter than this go straight to a decode worker, which "
                             "prefills them itself (default: 256)")
    parser.add_argument("--kv-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="how long a decode worker waits for a prompt's KV (default: 30)")
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


def router_config(args, model: Path, **membership):
    from router.app import RouterConfig

    return RouterConfig(
        served_model=args.served_model_name or args.model, model_dir=model,
        default_max_tokens=args.default_max_tokens, request_timeout_s=args.request_timeout,
        worker_ready_timeout_s=args.worker_ready_timeout,
        disaggregate_min_tokens=args.disaggregate_min_tokens, kv_timeout_s=args.kv_timeout,
        policy=args.policy, decode_admission=args.decode_admission,
        **{"worker_addresses": [], **membership})


def run(args: argparse.Namespace) -> int:
    try:
        model = resolve_model(args.model)
    except ModelError as error:
        print(f"pdserve router: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        asyncio.run(run_router(args, router_config(args, model, registry_url=args.registry,
                                                   cluster=args.cluster)))
    except KeyboardInterrupt:
        pass
    return 0


async def run_router(args, config) -> None:
    import uvicorn

    from router.app import create_app

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
    print(f"pdserve ready at {url}/v1 (model: {served_model})\n"
          f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{served_model}\", \"messages\": "
          f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'",
          file=sys.stderr, flush=True)
