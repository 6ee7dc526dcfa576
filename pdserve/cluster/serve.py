"""`pdserve serve`: the whole cluster on one host, with no Ray (and no Redis, unless several
routers share it).

Starts the workers as child processes, waits until their engines are ready, then runs the
router in this process. With `--routers N`, N-1 more routers run as child processes on the
next ports, sharing the flex split, the prefix index, the admission capacity and revoked keys
through a Redis server started here with a password (router/shared/state.py). Ctrl-C or
SIGTERM stops the routers and every child it started.
"""

import argparse
import os
import secrets
import signal
import socket
import sys
import tempfile
from pathlib import Path

from pdserve.cluster import local_services, serve_layout
from pdserve.cluster.console import say
from pdserve.cluster.local_workers import (
    core_shares,
    start_worker,
    stop_workers,
    threads_per_worker,
    wait_ready,
)
from pdserve.core.event_loop import run_on_fastest_loop
from pdserve.core.kinds import AUTO_TRANSPORT, Role, Transport
from pdserve.model_store.store import ModelError, resolve_model
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_secret import ensure_cluster_secret
from pdserve.settings.command_line import add_arguments, from_arguments
from pdserve.settings.engine import EngineSettings
from pdserve.settings.json_logs import configure_logging
from pdserve.settings.redis_url import PASSWORD_ENV
from pdserve.settings.router import RouterSettings
from pdserve.settings.worker import WorkerSettings
from pdserve.worker.engine_process import OMP_BIND_ENV
from pdserve.worker.fork_server import ForkServer
from pdserve.worker.processes import (
    ChildError,
    free_port,
    is_listening,
    spawn,
    stop_group,
    wait_until,
)
from router.command import check_files, run_router

CPU_BINDINGS = ("auto", "none", "split")
KV_POOL_SCOPES = ("host", "worker")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI API with the router and local workers",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--prefill", type=int, default=1, metavar="N", help="prefill workers (default: 1)"
    )
    parser.add_argument(
        "--decode", type=int, default=1, metavar="M", help="decode workers (default: 1)"
    )
    parser.add_argument(
        "--prefill-tensor-parallel-size",
        type=int,
        default=None,
        metavar="P",
        help="tensor-parallel size of the prefill workers, when it differs from the decode "
        "workers' --tensor-parallel-size (the KV transfer re-shards the heads) (default: the same)",
    )
    parser.add_argument(
        "--prefill-kv-transports",
        default="",
        metavar="KIND,...",
        help="one KV transport per prefill worker, comma-separated (e.g. grpc,shm), to compare "
        "them side by side in one cluster (default: --kv-transport for all)",
    )
    parser.add_argument(
        "--flex",
        type=int,
        default=0,
        metavar="N",
        help="N flex workers instead of --prefill/--decode: each can prefill or decode, the "
        "router gives half of them (rounded down) the prefill role and changes roles live "
        "(`pdserve roles`, --flex-auto) (default: 0)",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="routers over the same workers: router i listens on --port + i (on free ports "
        "with --port 0) and they share the cluster's state through a Redis server started "
        "here; any of them may stop and the others keep serving (default: 1)",
    )
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="no disaggregation: --workers colocated workers instead",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --colocated: number of colocated workers (default: 1)",
    )
    parser.add_argument(
        "--kv-pool-gib",
        type=float,
        default=2.0,
        metavar="GIB",
        help="with --kv-pool on: the host KV pool's memory (serve starts its store for the "
        "workers, kv_transfer/pool/store.py; one per tensor-parallel size among them, each of "
        "this size); a store never holds more, and evicts the least "
        "recently used blocks (a block read since it was last considered gets another round) "
        "(default: 2)",
    )
    parser.add_argument(
        "--kv-pool-scope",
        choices=KV_POOL_SCOPES,
        default="host",
        help="with --kv-pool on: host: one pool for this host's workers, which load what any "
        "of them computed; worker: a pool of --kv-pool-gib beside each worker, as in "
        "Kubernetes, where each pod runs its own store: a worker fetches what another's pool "
        "holds over gRPC first (docs/kv-pool.md#across-hosts) (default: host)",
    )
    parser.add_argument(
        "--decode-kv-pool",
        choices=("on", "off"),
        default="on",
        help="with --kv-pool on: off keeps the decode workers out of the pool (they store "
        "nothing there, and compute every prompt they prefill themselves): to measure what "
        "they add (docs/kv-pool.md#who-uses-it) (default: on)",
    )
    parser.add_argument(
        "--cpu-binding",
        choices=CPU_BINDINGS,
        default="auto",
        help="split: each worker gets its own equal share of this host's cores, its compute "
        "(OpenMP) threads pinned there (vLLM's VLLM_CPU_OMP_THREADS_BIND), while the router, "
        "the client and the workers' other threads stay unpinned; none: the OS places every "
        "thread; auto: split when every worker rank gets a core of its own, else none "
        "(default: auto; docs/operating.md says what each measured)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where worker logs go (default: a new temporary folder)",
    )
    add_arguments(
        parser,
        WorkerSettings,
        only=(
            "kv_failure_policy",
            "kv_send_buffer_mib",
            "kv_transport",
            "kv_integrity",
            "kv_pool",
            "otlp_endpoint",
        ),
    )
    add_arguments(parser, RouterSettings, exclude=("model", "registry", "cluster", "otlp_endpoint"))
    add_arguments(parser.add_argument_group("engine"), EngineSettings)
    serve_layout.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.layout == serve_layout.AUTO:
        try:
            report = print if args.dry_run else say  # a dry run's answer is its output
            # The model and dtype planned for; made again below, with the layout's TP sizes.
            planned = serve_layout.plan_layout(args, from_arguments(EngineSettings, args), report)
        except (ValueError, OSError, ModelError) as error:
            print(f"pdserve serve: {error}", file=sys.stderr)
            return 2
        report(f"layout: {planned.name} (pdserve serve {' '.join(planned.serve_arguments)})")
        if args.dry_run:
            return 0
        planned.apply(args)
    elif args.dry_run:
        print("pdserve serve: --dry-run: only with --layout auto", file=sys.stderr)
        return 2
    if not args.colocated and (args.decode < 1 or args.prefill < 0):
        print("pdserve serve: need --decode >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    if args.routers < 1:
        print("pdserve serve: --routers: must be >= 1", file=sys.stderr)
        return 2
    if (args.prefill_tensor_parallel_size or 1) < 1:
        print("pdserve serve: --prefill-tensor-parallel-size: must be >= 1", file=sys.stderr)
        return 2
    if args.kv_pool_gib <= 0:
        print("pdserve serve: --kv-pool-gib: must be > 0", file=sys.stderr)
        return 2
    transports = [kind for kind in args.prefill_kv_transports.split(",") if kind]
    if transports and (
        len(transports) != args.prefill or not set(transports) <= {AUTO_TRANSPORT, *Transport}
    ):
        print(
            f"pdserve serve: --prefill-kv-transports: need {args.prefill} of "
            f"{', '.join((AUTO_TRANSPORT, *Transport))}, got {args.prefill_kv_transports!r}",
            file=sys.stderr,
        )
        return 2
    try:
        engine = from_arguments(EngineSettings, args)
        # Workers listen on loopback, each on a free port (--host and --port are the router's).
        decode = from_arguments(
            WorkerSettings, args, role=Role.DECODE, engine=engine, host="127.0.0.1", port=0
        )
        router = from_arguments(
            RouterSettings, args, model=engine.model, otlp_endpoint=decode.otlp_endpoint
        )
        check_files(router)  # before any worker; the workers inherit the TLS folder
        ensure_cluster_secret()  # the workers inherit it; the router calls them with it
        model = resolve_model(engine.model)
        free_ports = router.port == 0  # the other routers then take free ports too
        listener = _listen(router.host, router.port)
        router = router.model_copy(update={"port": listener.getsockname()[1]})
    except (ConfigError, ModelError, OSError) as error:
        print(f"pdserve serve: {error}", file=sys.stderr)
        return 2
    configure_logging()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"worker logs: {log_dir}")
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    workers = []
    plan = _worker_plan(args, decode, transports)
    threads = threads_per_worker(len(plan))
    binds = [{}] * len(plan)
    sizes = [settings.engine.tensor_parallel_size for settings in plan]
    cores = sorted(os.sched_getaffinity(0))
    if args.cpu_binding == "split" or (args.cpu_binding == "auto" and sum(sizes) <= len(cores)):
        shares = core_shares(sizes, cores)
        binds = [{OMP_BIND_ENV: share} for share in shares]
        pairs = zip(plan, shares, strict=True)
        say("cores per worker: " + ", ".join(f"{w.role} {share}" for w, share in pairs))
    others, redis_group, pools, fork_server = [], 0, [], None
    try:
        plan = _with_kv_pools(plan, args, log_dir, pools)
        if args.routers > 1:
            os.environ[PASSWORD_ENV] = secrets.token_urlsafe(24)  # the children inherit it
            url, redis_group = local_services.start_redis(
                log_dir / "redis.log", os.environ[PASSWORD_ENV], dies_with_parent=True
            )
            router = router.model_copy(update={"registry": url})
            say(f"shared state: redis-server at {url} (password in ${PASSWORD_ENV})")
        say("importing vLLM once for all workers (pdserve/worker/fork_server.py)")
        fork_server = ForkServer(log_dir / "fork-server.log")
        for settings, bind in zip(plan, binds, strict=True):
            workers.append(start_worker(settings, log_dir, threads, bind, fork_server=fork_server))
        wait_ready(workers, router.worker_ready_timeout_s, progress=say)
        addresses = [worker.address for worker in workers]
        serving = router.model_copy(update={"worker_addresses": addresses})
        others = _start_other_routers(serving, args.routers - 1, free_ports, log_dir)
        run_on_fastest_loop(run_router(serving, model, listener))
        return 0
    except (RuntimeError, ChildError) as error:  # ForkServerError included
        say(f"pdserve serve: {error}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        listener.close()
        for process in others:
            stop_group(process.pid, process=process)
        if workers:
            say(f"stopping {len(workers)} worker(s)")
        stop_workers(workers)
        if fork_server is not None:
            fork_server.close()
        if redis_group:
            stop_group(redis_group)
        for pool in pools:
            stop_group(pool.pid, process=pool)


def _with_kv_pools(plan: list, args, log_dir: Path, started: list) -> list:
    """The plan's workers with their KV pool's address (those of `--kv-pool on`), each store
    started (and added to `started`, to be stopped): one for the host (one per tensor-parallel
    size: WorkerSettings.kv_pool_group), or one per worker."""
    budget = int(args.kv_pool_gib * 2**30)
    pooled = [i for i, worker in enumerate(plan) if worker.wants_kv_pool]
    if args.kv_pool_scope == "host":
        by_group: dict[str, list[int]] = {}
        for i in pooled:
            by_group.setdefault(plan[i].kv_pool_group, []).append(i)
        groups = list(by_group.values())
    else:
        groups = [[i] for i in pooled]
    plan = list(plan)
    for number, group in enumerate(groups):
        log_path = log_dir / (f"kv-pool-{number}.log" if len(groups) > 1 else "kv-pool.log")
        address, process = local_services.start_kv_pool(log_path, budget)
        started.append(process)
        for i in group:
            plan[i] = plan[i].model_copy(update={"kv_pool_address": address})
        say(f"KV pool: {args.kv_pool_gib:g} GiB of host memory at {address} ({len(group)} workers)")
    return plan


def _start_other_routers(
    serving: RouterSettings, count: int, free_ports: bool, log_dir: Path
) -> list:
    """`count` more routers (`pdserve router`) over the same workers and shared state, on the
    ports after the first router's (or free ones), each listening before this returns."""
    started = []
    try:
        for i in range(1, count + 1):
            port = free_port() if free_ports else serving.port + i
            log = log_dir / f"router-{i}.log"
            settings = serving.model_copy(update={"port": port}).model_dump_json()
            command = [sys.executable, "-m", "pdserve.cli", "router"]
            process = spawn([*command, "--settings-json", settings], log)
            started.append(process)
            wait_until(lambda p=port: is_listening(p), process, 120, f"router {i}", log)
            say(f"router {i} at http://{serving.host}:{port}/v1")
    except BaseException:
        for process in started:
            stop_group(process.pid, process=process)
        raise
    return started


def _worker_plan(args, decode: WorkerSettings, transports: list[str]) -> list[WorkerSettings]:
    """Each worker to start: `decode` has the engine and the decode pool's settings;
    `transports`, if given, one KV transport per prefill worker."""
    if args.colocated:
        return [decode.model_copy(update={"role": Role.COLOCATED})] * args.workers
    if args.flex:
        return [decode.model_copy(update={"role": Role.FLEX})] * args.flex
    prefill_pool = decode.kv_pool
    if args.decode_kv_pool == "off":
        decode = decode.model_copy(update={"kv_pool": "off"})
    engine = decode.engine
    if args.prefill_tensor_parallel_size is not None:
        engine = engine.model_copy(
            update={"tensor_parallel_size": args.prefill_tensor_parallel_size}
        )
    prefill = decode.model_copy(
        update={"role": Role.PREFILL, "engine": engine, "kv_pool": prefill_pool}
    )
    prefills = [prefill.model_copy(update={"kv_transport": kind}) for kind in transports] or [
        prefill
    ] * args.prefill
    return prefills + [decode] * args.decode


def _listen(host: str, port: int) -> socket.socket:
    """The router's socket, listening from the start: the workers that start before the router
    take free ports of their own, and one could otherwise be handed the router's port while it
    is not yet bound (seen: the router failing with "address already in use")."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return sock


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
