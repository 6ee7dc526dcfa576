"""The engine factory: one place that turns pdserve's engine options into a vLLM AsyncLLM.

Every role (colocated, prefill, decode) builds its engine here, so the settings that must match
between a prefill and a decode worker (dtype, block size, max length) come from one source.
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MAX_UNCLAIMED_TRANSFERS = 4096


@dataclass(frozen=True)
class EngineOptions:
    model: Path
    dtype: str = "float32"          # float32 on CPU: bfloat16 was 4x slower on AVX2 cores
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_gib: float = 2.0
    enforce_eager: bool = True      # torch.compile took 139 s to start on CPU, for no gain
    seed: int = 0
    tensor_parallel_size: int = 1
    quantization: str | None = None  # vLLM's, e.g. "fp8" (GPU)
    role: str = "colocated"         # "prefill" sends KV, "decode" receives it
    kv_host: str = "127.0.0.1"      # decode: the KV receiver's bind address
    kv_port: int = 0                # decode: the KV receiver's port (rank r uses port + r)
    kv_failure_policy: str = "recompute"  # decode: when KV does not arrive: recompute or fail

    def kv_transfer_config(self) -> dict | None:
        if self.role == "colocated":
            return None
        return {
            "kv_connector": "PdserveConnector",
            "kv_connector_module_path": "kv_transfer.connector",
            "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
            "kv_load_failure_policy": self.kv_failure_policy,
            "kv_connector_extra_config": {"receiver_host": self.kv_host,
                                          "receiver_port": self.kv_port},
        }


class EngineStats:
    """The engine's latest scheduler report, kept by a vLLM stat logger.

    vLLM reports scheduler stats after each engine step, so an idle engine keeps its last
    report; `age_seconds` says how old it is.
    """

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.updated_at = time.monotonic()
        self.kv_transfers: dict[str, dict] = {}  # transfer id -> connector's figures

    def take_kv_transfer(self, transfer_id: str) -> dict | None:
        return self.kv_transfers.pop(transfer_id, None)

    def update(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        self.running, self.waiting, self.kv_cache_usage = running, waiting, kv_cache_usage
        self.updated_at = time.monotonic()

    def age_seconds(self) -> float:
        return time.monotonic() - self.updated_at


def _stat_logger_factory(stats: EngineStats):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerStatsLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is None:
                return
            stats.update(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                         scheduler_stats.kv_cache_usage)
            for transfer in (scheduler_stats.kv_connector_stats or {}).get("transfers", ()):
                stats.kv_transfers[transfer["transfer_id"]] = transfer
            while len(stats.kv_transfers) > MAX_UNCLAIMED_TRANSFERS:  # their requests were aborted
                stats.kv_transfers.pop(next(iter(stats.kv_transfers)))

        def log_engine_initialized(self):
            pass

    return SchedulerStatsLogger


PLACEMENT_GROUP_ENV = "PDSERVE_PLACEMENT_GROUP"  # set by cluster/ray_launcher for TP > 1 on GPUs
RAY_NAMESPACE_ENV = "PDSERVE_RAY_NAMESPACE"


def make_engine(options: EngineOptions, stats: EngineStats):
    """Start vLLM's AsyncLLM (its engine core runs in child processes)."""
    # A KV connector makes vLLM reserve cores for itself; a 2-core machine has none to spare.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # vLLM's automatic binding pinned every worker of a host (and so their KV transfer
    # threads) to the same core, which starved the transfers; let the OS place threads.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=str(options.model),
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        kv_cache_memory_bytes=int(options.kv_cache_gib * GIB),
        enforce_eager=options.enforce_eager,
        seed=options.seed,
        tensor_parallel_size=options.tensor_parallel_size,
        quantization=options.quantization,
        kv_transfer_config=options.kv_transfer_config(),
        disable_log_stats=True,
    )
    loggers = [_stat_logger_factory(stats)]
    group = _ray_placement_group(options)
    if group is None:
        return AsyncLLM.from_engine_args(args, stat_loggers=loggers)
    args.distributed_executor_backend = "ray"
    config = args.create_engine_config()
    config.parallel_config.placement_group = group
    return AsyncLLM.from_vllm_config(config, stat_loggers=loggers)


def _ray_placement_group(options: EngineOptions):
    """A tensor-parallel GPU worker started by `pdserve up` runs vLLM's Ray executor in its own
    placement group (named by the launcher), one GPU bundle per rank. On CPU vLLM has no Ray
    executor and tensor parallelism uses its multiprocessing one."""
    from vllm.platforms import current_platform

    name = os.environ.get(PLACEMENT_GROUP_ENV)
    if options.tensor_parallel_size == 1 or not name or not current_platform.ray_device_key:
        return None
    import ray
    from ray.util.placement_group import get_placement_group

    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=os.environ[RAY_NAMESPACE_ENV],
                 log_to_driver=False)
    return get_placement_group(name)


def add_engine_arguments(parser) -> None:
    """The engine options every command that starts workers accepts."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default="smollm2",
                       help="a model name made by `pdserve model` (smollm2, tiny) or a Hugging "
                            "Face folder (default: smollm2)")
    group.add_argument("--dtype", default="float32",
                       help="weights and activations dtype (default: float32, fastest on CPU)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length in tokens (default: the model's own)")
    group.add_argument("--kv-cache-gib", type=float, default=2.0,
                       help="KV cache size per worker in GiB (default: 2)")
    group.add_argument("--seed", type=int, default=0, help="engine random seed (default: 0)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs per worker (default: 1)")
    group.add_argument("--quantization", default=None,
                       help="vLLM quantization method, e.g. fp8 (default: none)")


def engine_options(args, model: Path, **role_options) -> EngineOptions:
    return EngineOptions(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                         kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                         tensor_parallel_size=args.tensor_parallel_size,
                         quantization=args.quantization, **role_options)


def engine_argv(args) -> list[str]:
    """The same engine options as command-line arguments, to start a worker process."""
    argv = ["--model", args.model, "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib),
            "--seed", str(args.seed), "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    return argv
