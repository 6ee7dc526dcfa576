"""`pdserve worker`: one worker process, a vLLM engine behind the worker gRPC service.

The gRPC port (the worker service and grpc.health.v1) and the Prometheus endpoint open as soon
as the engine's process has started (a few seconds in: it must not inherit a gRPC server,
pdserve/worker/engine_process.py), and Health answers STARTING while the engine loads, so a
launcher can tell "still starting" from "dead". SIGTERM or SIGINT stops the server, then the
engine and its child processes, then removes the folder of the engine's IPC sockets
(pdserve/worker/rpc_folder.py); a stop still running after SHUTDOWN_DEADLINE_S ends the process
anyway (its group reaper then takes the engine processes and the folder).
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from typing import NoReturn

import grpc

from pdserve.core.event_loop import run_on_fastest_loop
from pdserve.core.heap import freeze_startup_heap
from pdserve.core.kinds import Role
from pdserve.model_store.store import ModelError, resolve_model
from pdserve.protocol import GRPC_OPTIONS, worker_pb2_grpc
from pdserve.protocol.data_parallel import kv_receivers
from pdserve.settings import tls
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_secret import cluster_secret, load_cluster_secret
from pdserve.settings.command_line import add_arguments, add_settings_json, from_arguments
from pdserve.settings.json_logs import configure_logging
from pdserve.settings.worker import WorkerSettings
from pdserve.worker import engine as engine_factory
from pdserve.worker import group_reaper, rpc_folder, shm_leftovers
from pdserve.worker.engine_process import EngineProcessStart
from pdserve.worker.grpc_health import SecretCheckButHealth, add_health, serve_health_alone
from pdserve.worker.metrics_server import WorkerMetrics, serve_metrics
from pdserve.worker.processes import free_port

log = logging.getLogger("pdserve.worker")
SHUTDOWN_DEADLINE_S = 30.0  # longest a stop may take (the drain, if any, came before it)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run one worker process (a vLLM engine behind gRPC)",
        description=__doc__.splitlines()[0],
    )
    add_arguments(parser, WorkerSettings)
    add_settings_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    configure_logging()
    try:
        settings = from_arguments(WorkerSettings, args)
        load_cluster_secret(settings.cluster_secret_file)
        tls.load_tls_dir(settings.tls_dir)
        model = resolve_model(settings.engine.model)
    except (ConfigError, ModelError) as error:
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    rpc_sockets = rpc_folder.make_private()  # before vLLM reads VLLM_RPC_BASE_PATH
    if rpc_sockets is not None:
        log.info("vLLM's IPC sockets in %s, removed when the worker stops", rpc_sockets)
    group_reaper.start_for_this_worker(rpc_sockets)
    try:  # serve_worker returns once its engine's processes have exited, on every path
        code = run_on_fastest_loop(serve_worker(settings, model))
    finally:
        rpc_folder.remove(rpc_sockets)
    _exit_now(code)


async def serve_worker(settings: WorkerSettings, model) -> int:
    from pdserve.worker.service import WorkerService

    port = settings.port or free_port(settings.host)
    host = advertised_host(settings)
    worker_id = settings.worker_id or f"{settings.role}@{host}:{port}"
    kv_port = settings.kv_port
    receives = settings.role in (Role.DECODE, Role.FLEX)  # a KV receiver listens
    if receives and not kv_port:
        engine = settings.engine
        receivers = kv_receivers(engine.data_parallel_ranks, engine.tensor_parallel_size)
        kv_port = free_port(settings.host, count=receivers)
    kv_address = f"{host}:{kv_port}" if receives else ""
    metrics = WorkerMetrics()
    service = WorkerService(
        worker_id,
        settings.role,
        str(model),
        kv_address,
        settings.kv_failure_policy if receives else "",
        settings.kv_transport,
        settings.kv_pool_address if settings.pooled else "",
        metrics,
    )
    settings = settings.model_copy(update={"advertise_host": host})
    metrics.follow_state(service)
    if settings.kv_pool_address and not settings.pooled:
        log.warning(
            "worker %s uses no KV pool (kv_pool %s, kv_failure_policy %s)",
            worker_id,
            settings.kv_pool,
            settings.kv_failure_policy,
        )
    if settings.pooled:
        metrics.follow_kv_pool(settings.kv_pool_address, service.engine_stats)

    # The engine starts first: a forked engine process must inherit neither a gRPC server
    # (pdserve/worker/engine_process.py) nor this loop's signal handling (its signals would
    # wake this loop: SIGTERM to the engine would stop the worker). It comes back through
    # `started`, not as the thread's result: asyncio's and the thread pool's futures keep a
    # result alive until interpreter exit, where AsyncLLM.__del__ then failed ("'NoneType'
    # object is not callable").
    log.info("worker %s starting the engine", worker_id)
    process_start = EngineProcessStart()
    shm_before = shm_leftovers.vllm_files()  # what a failed start may leave is new
    started: list = []
    starting = asyncio.create_task(
        asyncio.to_thread(
            lambda: started.append(
                engine_factory.make_engine(
                    settings, model, kv_port, service.engine_stats, metrics, process_start
                )
            )
        )
    )
    await process_start.wait(starting)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = grpc.aio.server(
        options=GRPC_OPTIONS, interceptors=[SecretCheckButHealth(cluster_secret())]
    )
    tls.add_port(server, f"{settings.host}:{port}")
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    add_health(server, service)
    serve_metrics(settings.host, settings.metrics_port)
    await server.start()
    health = None  # the plaintext health port, for probes when the gRPC port has TLS
    if settings.health_port:
        health = await serve_health_alone(service, f"{settings.host}:{settings.health_port}")
    log.info("worker %s listening on %s:%d while its engine loads", worker_id, settings.host, port)

    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stop requested while the engine starts: stopping once it has started")
        await stop_serving(server, service, health, grace=0)
        with contextlib.suppress(Exception):  # a failed start has nothing to shut down
            await starting
            started.pop().shutdown()
        _remove_start_leftovers(shm_before)
        return 0
    try:
        starting.result()
        engine = started.pop()
    except Exception as error:  # the engine could not start: say why, then exit
        log.exception("engine failed to start")  # in the log before the health says so
        service.engine_failed(f"engine failed to start: {error}")
        await stop_serving(server, service, health, grace=1)
        _remove_start_leftovers(shm_before)
        return 1
    freeze_startup_heap()  # vLLM, torch and the engine's client (pdserve/core/heap.py)
    service.engine_ready(engine)
    log.info(
        "worker %s ready (max_model_len=%d, kv blocks=%d)",
        worker_id,
        service.identity.max_model_len,
        service.kv_blocks_total,
    )
    membership = None
    if settings.registry:
        membership = await _join_registry(settings, service, f"{host}:{port}")
        if membership is None:
            stop.set()
    await stopping
    log.info("worker %s stopping", worker_id)
    _exit_if_stuck_after(SHUTDOWN_DEADLINE_S)
    if membership is not None:
        await membership.leave()
        await membership.registry.close()
    await stop_serving(server, service, health, grace=2)
    if service.pool_peers is not None:
        await service.pool_peers.close()
    engine_processes = shm_leftovers.engine_processes()
    engine_shm = shm_leftovers.mapped_by([process.pid for process in engine_processes])
    engine.shutdown()
    if removed := shm_leftovers.remove_once_gone(engine_processes, engine_shm):
        log.info("removed what the engine left in /dev/shm: %s", _names(removed))
    # Drop every reference, so AsyncLLM.__del__ does not shut down again at interpreter exit.
    service.engine = None
    del engine
    return 0


def _remove_start_leftovers(shm_before: set) -> None:
    """Remove what an engine that never served (its start failed, or a stop came first) left in
    /dev/shm: the vLLM files new since `shm_before` that no process maps once its processes are
    gone. A stop during a TP start signals the ranks too, and they die with their communicator's
    files made."""
    if removed := shm_leftovers.remove_after_failed_start(
        shm_leftovers.engine_processes(), shm_before
    ):
        log.info("removed what the engine's start left in /dev/shm: %s", _names(removed))


def _names(paths: list) -> str:
    return " ".join(path.name for path in paths)


async def stop_serving(server, service, health, grace: float) -> None:
    """Stop the gRPC server (calls still running get `grace` seconds; the routers' sessions end
    as soon as their requests have), then the health port."""
    service.stop_sessions()
    await server.stop(grace=grace)
    if health is not None:
        await health.stop(grace=None)


async def _join_registry(settings: WorkerSettings, service, address: str):
    """Join the pools; None (and the worker stops) when the registry cannot be reached."""
    from pdserve.protocol.registry import Registry, WorkerRecord, recorded_load
    from pdserve.worker.membership import WorkerMembership, placement_from_environment

    node, gpu_ids = placement_from_environment()
    record = WorkerRecord(service.identity, address, node, gpu_ids)
    registry = Registry(settings.registry, settings.cluster)
    membership = WorkerMembership(
        registry, record, settings.heartbeat_s, lambda: recorded_load(service.stats_reply())
    )
    try:
        await membership.join()
    except Exception as error:
        log.error("cannot join the registry at %s: %s", registry.url, error)
        service.engine_failed(f"cannot join the registry at {registry.url}: {error}")
        await registry.close()
        return None
    service.leave_pools = membership.leave
    return membership


def _exit_now(code: int) -> NoReturn:
    """Exit once the server and the engine have stopped: what is left (memory, sockets, file
    descriptors) the kernel frees, and the interpreter's own teardown of torch and vLLM took
    another ~2.5 s of every stop here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_if_stuck_after(seconds: float) -> None:
    """A stop that hangs (an engine that does not shut down) ends the process anyway; its group
    reaper then takes the engine processes with it."""

    def give_up() -> None:
        log.error("worker still stopping after %.0f s: exiting now", seconds)
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()


def advertised_host(settings: WorkerSettings) -> str:
    if settings.advertise_host:
        return settings.advertise_host
    if settings.host in ("0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return settings.host
