"""`pdserve router`: the router alone, following a cluster's Redis registry (what `pdserve up`
starts), and the start-up that `pdserve serve` shares with it."""

import argparse
import asyncio
import sys

from pdserve.core.event_loop import run_on_fastest_loop
from pdserve.core.heap import freeze_startup_heap
from pdserve.model_store.store import ModelError, resolve_model
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_secret import load_cluster_secret
from pdserve.settings.command_line import add_arguments, add_settings_json, from_arguments
from pdserve.settings.json_logs import configure_logging
from pdserve.settings.router import RouterSettings
from pdserve.settings.tls import load_tls_dir
from router.http.api_keys import load_api_keys

LIMIT_CONCURRENCY = 8192  # connections (streams included) and requests one router holds at once
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="run the router alone, following a Redis registry of workers",
        description=__doc__.splitlines()[0],
    )
    add_arguments(parser, RouterSettings)
    add_settings_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = from_arguments(RouterSettings, args)
        if not settings.registry and not settings.worker_addresses:
            raise ConfigError("--registry: the router needs a registry to follow")
        check_files(settings)
        model = resolve_model(settings.model)
    except (ConfigError, ModelError) as error:
        print(f"pdserve router: {error}", file=sys.stderr)
        return 2
    configure_logging()
    try:
        run_on_fastest_loop(run_router(settings, model))
    except KeyboardInterrupt:
        pass
    return 0


def check_files(settings: RouterSettings) -> None:
    """Read every file the settings name (API keys, cluster secret, TLS folder), so that one that
    cannot be read stops the router (and `pdserve serve`, before any worker) with a ConfigError."""
    load_api_keys(settings)
    load_cluster_secret(settings.cluster_secret_file)
    load_tls_dir(settings.tls_dir)


async def run_router(settings: RouterSettings, model: str, listener=None) -> None:
    """Serve until stopped; on `listener` (a bound, listening socket) when given."""
    import uvicorn

    from pdserve.core import tracing
    from router.app import create_app

    tracing.export_to(settings.otlp_endpoint, "pdserve-router")
    server = uvicorn.Server(server_config(create_app(settings, model), settings))
    announce = asyncio.create_task(_announce_when_started(server, settings))
    try:
        await server.serve(sockets=[listener] if listener is not None else None)
    finally:
        announce.cancel()
        tracing.flush()


def server_config(app, settings: RouterSettings):
    """uvicorn's settings for the router: at most LIMIT_CONCURRENCY connections and requests
    at once (a 503 beyond), idle keep-alive connections closed after KEEP_ALIVE_S (security
    review L11; router/http/body.py bounds the time and bytes of the bodies being read)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        limit_concurrency=LIMIT_CONCURRENCY,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


async def _announce_when_started(server, settings: RouterSettings) -> None:
    """Once the server serves: its startup heap frozen, and how to call it printed. Its start
    may wait for the workers to load (`worker_ready_timeout_s`, minutes for a large model), so
    this waits as long as the server runs (run_router cancels it when the server stops)."""
    while not server.started:
        await asyncio.sleep(0.1)
    freeze_startup_heap()  # the app, its tokenizer and the server (pdserve/core/heap.py)
    url = f"http://{settings.host}:{settings.port}"
    served_model = settings.served_model
    print(
        f"pdserve ready at {url}/v1 (model: {served_model})\n"
        f"try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{served_model}", "messages": '
        f'[{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}\'',
        file=sys.stderr,
        flush=True,
    )
