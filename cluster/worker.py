"""`pdserve worker`: one worker process, a vLLM engine behind the worker gRPC service.

The gRPC port opens first and answers Health with STARTING while the engine loads, so a
launcher can tell "still starting" from "dead". SIGTERM or SIGINT stops the server, then the
engine and its child processes.
"""

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys

from cluster import engine as engine_factory
from cluster.model_store import ModelError, resolve_model
from cluster.protocol import GRPC_OPTIONS, worker_pb2_grpc

ROLES = ("colocated", "prefill", "decode")
log = logging.getLogger("pdserve.worker")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "worker", help="run one worker process (a vLLM engine behind gRPC)",
        description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=ROLES, default="colocated",
                        help="colocated: prefills and decodes its own requests; prefill: computes "
                             "prompts and sends their KV; decode: receives KV and decodes (and "
                             "prefills short prompts itself) (default: colocated)")
    parser.add_argument("--kv-port", type=int, default=0,
                        help="decode: port of the KV receiver, rank r of a tensor-parallel worker "
                             "uses PORT + r (default: 0, any free port at TP 1)")
    parser.add_argument("--kv-failure-policy", choices=("recompute", "fail"),
                        default="recompute",
                        help="decode: when a prompt's KV does not arrive in time, prefill it "
                             "locally (recompute) or end the request with an error (fail) "
                             "(default: recompute)")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051; 0: any free port)")
    parser.add_argument("--worker-id", default=None,
                        help="name in logs and stats (default: ROLE@HOST:PORT)")
    parser.add_argument("--advertise-host", default="",
                        help="the host others reach this worker at (default: --host, or this "
                             "host's address when --host is 0.0.0.0)")
    parser.add_argument("--registry", default="", metavar="REDIS_URL",
                        help="join the pools in this Redis registry once the engine is ready, "
                             "with a heartbeat (default: none, as under `pdserve serve`)")
    parser.add_argument("--cluster", default="pdserve",
                        help="the cluster's name in the registry (default: pdserve)")
    parser.add_argument("--heartbeat", type=float, default=1.0, metavar="SECONDS",
                        help="registry heartbeat; missing two takes the worker out of the pools "
                             "(default: 1)")
    engine_factory.add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        model = resolve_model(args.model)
    except ModelError as error:
        print(f"pdserve worker: {error}", file=sys.stderr)
        return 2
    return asyncio.run(serve_worker(args, model))


async def serve_worker(args: argparse.Namespace, model) -> int:
    from cluster.worker_service import WorkerService

    server = grpc_server()
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    host = advertised_host(args)
    worker_id = args.worker_id or f"{args.role}@{host}:{port}"
    kv_port = args.kv_port
    if args.role == "decode" and not kv_port:
        from cluster.worker_process import free_port

        kv_port = free_port(args.host)
    kv_address = f"{host}:{kv_port}" if args.role == "decode" else ""
    service = WorkerService(worker_id, args.role, str(model), kv_address,
                            args.kv_failure_policy if args.role == "decode" else "")
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    await server.start()
    log.info("worker %s listening on %s:%d; starting the engine", worker_id, args.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    options = engine_factory.engine_options(args, model, role=args.role, kv_host=args.host,
                                            kv_port=kv_port,
                                            kv_failure_policy=args.kv_failure_policy)
    # The engine comes back through `started`, not as the thread's result: asyncio's and the
    # thread pool's futures keep a result alive until interpreter exit, where AsyncLLM.__del__
    # then failed ("'NoneType' object is not callable").
    started: list = []
    starting = asyncio.create_task(asyncio.to_thread(
        lambda: started.append(engine_factory.make_engine(options, service.engine_stats))))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stop requested while the engine starts: stopping once it has started")
        await server.stop(grace=0)
        with contextlib.suppress(Exception):  # a failed start has nothing to shut down
            await starting
            started.pop().shutdown()
        return 0
    try:
        starting.result()
        engine = started.pop()
    except Exception as error:  # the engine could not start: say why, then exit
        service.engine_failed(f"engine failed to start: {error}")
        log.exception("engine failed to start")
        await server.stop(grace=1)
        return 1
    service.engine_ready(engine)
    log.info("worker %s ready (max_model_len=%d, kv blocks=%d)", worker_id,
             service.max_model_len, service.kv_blocks_total)
    membership = None
    if args.registry:
        membership = await _join_registry(args, service, f"{host}:{port}", engine)
        if membership is None:
            stop.set()
    await stopping
    log.info("worker %s stopping", worker_id)
    if membership is not None:
        await membership.leave()
        await membership.registry.close()
    await server.stop(grace=2)
    engine.shutdown()
    # Drop every reference, so AsyncLLM.__del__ does not shut down again at interpreter exit.
    service.engine = None
    del engine
    return 0


async def _join_registry(args, service, address: str, engine):
    """Join the pools; None (and the worker stops) when the registry cannot be reached."""
    from cluster.registry import Registry, WorkerRecord
    from cluster.worker_membership import (WorkerMembership, compatibility_hash, load_of,
                                           placement_from_environment)
    from kv_transfer.connector import compatibility_of

    node, gpu_ids = placement_from_environment()
    record = WorkerRecord(
        worker_id=service.worker_id, role=service.role, address=address,
        kv_address=service.kv_address,
        tensor_parallel_size=engine.vllm_config.parallel_config.tensor_parallel_size,
        compatibility_hash=compatibility_hash(compatibility_of(engine.vllm_config).to_dict()),
        node=node, gpu_ids=gpu_ids)
    registry = Registry(args.registry, args.cluster)
    membership = WorkerMembership(registry, record, args.heartbeat,
                                  lambda: load_of(service.stats_reply()))
    try:
        await membership.join()
    except Exception as error:
        log.error("cannot join the registry at %s: %s", args.registry, error)
        service.engine_failed(f"cannot join the registry at {args.registry}: {error}")
        await registry.close()
        return None
    service.leave_pools = membership.leave
    return membership


def advertised_host(args) -> str:
    if args.advertise_host:
        return args.advertise_host
    if args.host in ("0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return args.host


def grpc_server():
    import grpc

    return grpc.aio.server(options=GRPC_OPTIONS)
