"""`pdserve plan`: capacity figures for one model replica on one GPU type, or with `--gpus N` the
configuration of N GPUs (a prefill:decode split with replicas and TP per pool, or colocated
replicas) with the highest simulated goodput per GPU.

The search simulates every configuration with the roofline cost model, or with step costs
measured on a real cluster (`--calibration`; planner.search); its workload options take
bench's forms, so a plan and a later `pdserve bench` describe the same load.
"""

import argparse
import json
import sys
from dataclasses import asdict

from pdserve.bench.metrics import Slo
from pdserve.bench.workload import DEFAULT_INPUT_LEN, Length
from pdserve.core.gpu_spec import GB, GPU_PRESETS, GpuSpec, gpu_preset
from pdserve.core.kinds import Role
from pdserve.core.progress import Progress
from pdserve.planner.calibration import Calibration
from pdserve.planner.capacity import (
    DEFAULT_EP_BANDWIDTH,
    DEFAULT_RESERVE_FRACTION,
    GIB,
    CapacityPlan,
    kv_bytes_per_token,
    plan_capacity,
)
from pdserve.planner.cluster_file import cluster_document, write_cluster_file
from pdserve.planner.memory_fit import (
    DEFAULT_SEND_BUFFER_MIB,
    GpuMemoryUse,
    gpu_memory_use,
    kv_cache_gib_that_fits,
)
from pdserve.planner.model_spec import DTYPE_BYTES, MODEL_PRESETS, ModelSpec, load_model_spec
from pdserve.planner.search import (
    CalibratedHardware,
    Candidate,
    Evaluation,
    RooflineHardware,
    Scenario,
    search,
)
from pdserve.planner.sim_workload import WorkloadSpec

DEFAULT_GPU = "A100-80GB"


def _checked(convert, accept, what: str):
    """An argparse `type` that converts the text and rejects values `accept` refuses."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


_positive_int = _checked(int, lambda value: value > 0, "a positive integer")
_positive_float = _checked(float, lambda value: value > 0, "a positive number")
_fraction = _checked(float, lambda value: 0 <= value < 1, "a fraction in [0, 1)")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="capacity math: weights, KV cache, concurrency, step times",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="PRESET_OR_CONFIG",
        help=f"a preset ({', '.join(MODEL_PRESETS)}) "
        "or the path of an HF config.json or its folder",
    )
    parser.add_argument(
        "--gpu", metavar="PRESET", help=f"{', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})"
    )
    custom = parser.add_argument_group("custom GPU", "give all three instead of --gpu")
    custom.add_argument(
        "--gpu-memory-gb", type=_positive_float, metavar="GB", help="GPU memory in GB (decimal)"
    )
    custom.add_argument(
        "--gpu-bandwidth-gbs",
        type=_positive_float,
        metavar="GB_PER_S",
        help="memory bandwidth in GB/s",
    )
    custom.add_argument(
        "--gpu-tflops", type=_positive_float, metavar="TFLOPS", help="dense FP16/BF16 tensor TFLOPS"
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPE_BYTES), help="weights and KV cache (default: the model's own)"
    )
    parser.add_argument(
        "--context-tokens",
        type=_positive_int,
        default=8192,
        help="tokens per request, prompt plus output (default 8192)",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        help="decode batch for the step time at batch (default: as many requests as fit)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="TP",
        help="GPUs one replica spans; divides weights and KV (default 1)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=1,
        metavar="DP",
        help="data-parallel ranks of a group, each TP GPUs with its own KV cache and batch "
        "(default 1); the figures are one rank's",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="shard a MoE model's routed experts over the group's DP x TP GPUs",
    )
    parser.add_argument(
        "--ep-bandwidth-gbs",
        type=_positive_float,
        default=DEFAULT_EP_BANDWIDTH / GB,
        metavar="GB_PER_S",
        help="one GPU's all-to-all bandwidth under expert parallelism "
        f"(default {DEFAULT_EP_BANDWIDTH / GB:g}, a 400 Gb/s NIC per GPU)",
    )
    parser.add_argument(
        "--reserve-fraction",
        type=_fraction,
        default=DEFAULT_RESERVE_FRACTION,
        help=f"GPU memory kept back from weights and KV cache (default {DEFAULT_RESERVE_FRACTION}, "
        "as vLLM's gpu_memory_utilization 0.9)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    _add_search_arguments(parser)
    parser.set_defaults(run=run)


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    search = parser.add_argument_group(
        "prefill:decode search",
        "with --gpus: simulate every split of the GPUs, and colocated replicas, and recommend "
        "one (--tensor-parallel-size, --batch and --context-tokens are then not used)",
    )
    search.add_argument(
        "--gpus",
        type=_positive_int,
        metavar="N",
        help="GPUs to split into a prefill and a decode pool, or to run colocated replicas on",
    )
    search.add_argument(
        "--calibration",
        metavar="FILE",
        help="step costs measured on a real cluster (scripts/validate_simulator.py "
        "--write-calibration) instead of the GPU's roofline; a GPU is then one measured worker",
    )
    search.add_argument(
        "--slo",
        metavar="OBJECTIVES",
        help='with --gpus (required): e.g. "ttft=500ms,tpot=50ms" (keys ttft, tpot, e2e)',
    )
    search.add_argument(
        "--rate",
        type=_positive_float,
        metavar="REQ_PER_S",
        help="compare at this request rate (default: each split at the highest rate "
        "where --attainment of its requests meet the SLO)",
    )
    search.add_argument(
        "--attainment",
        type=_checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
        default=0.9,
        help="share of requests that must meet the SLO (default 0.9)",
    )
    search.add_argument(
        "--workload",
        choices=("synthetic", "mixed"),
        default="synthetic",
        help="synthetic lengths, or a fraction of long prompts among short ones "
        "(default synthetic)",
    )
    search.add_argument(
        "--input-len",
        metavar="DIST",
        help="prompt tokens: N, LOW-HIGH or normal:MEAN,STD (default: synthetic "
        f"{DEFAULT_INPUT_LEN['synthetic']}, mixed {DEFAULT_INPUT_LEN['mixed']})",
    )
    search.add_argument(
        "--output-len",
        default="128",
        metavar="DIST",
        help="output tokens, same forms (default 128)",
    )
    search.add_argument(
        "--long-fraction",
        type=_checked(float, lambda v: 0 <= v <= 1, "a fraction"),
        default=0.1,
        help="mixed: fraction of long prompts (default 0.1)",
    )
    search.add_argument(
        "--long-input-len",
        default="normal:1500,150",
        metavar="DIST",
        help="mixed: tokens of a long prompt (default normal:1500,150)",
    )
    search.add_argument(
        "--num-requests",
        type=_positive_int,
        default=200,
        help="simulated requests per run (default 200)",
    )
    search.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="gamma shape of inter-arrival times, 1 = Poisson (default 1)",
    )
    search.add_argument(
        "--seed", type=int, default=0, help="seed for lengths and arrivals (default 0)"
    )
    search.add_argument(
        "--kv-bandwidth-gbs",
        type=_positive_float,
        default=25.0,
        metavar="GB_PER_S",
        help="prefill-to-decode KV transfer bandwidth (default 25, a 200 Gb/s NIC)",
    )
    search.add_argument(
        "--kv-latency-ms",
        type=_checked(float, lambda v: v >= 0, "a non-negative number"),
        default=1.0,
        metavar="MS",
        help="fixed cost of one KV transfer (default 1)",
    )
    search.add_argument(
        "--write-cluster",
        metavar="FILE",
        help="write the recommended configuration as a cluster YAML file",
    )


def run(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        return _run_search(args)
    try:
        plan = plan_capacity(
            load_model_spec(args.model, args.dtype),
            _gpu(args),
            context_tokens=args.context_tokens,
            batch_size=args.batch,
            tensor_parallel_size=args.tensor_parallel_size,
            reserve_fraction=args.reserve_fraction,
            data_parallel_size=args.data_parallel_size,
            expert_parallel=args.expert_parallel,
            kv_bandwidth=args.kv_bandwidth_gbs * GB,
            ep_bandwidth=args.ep_bandwidth_gbs * GB,
        )
    except (ValueError, OSError) as error:
        print(f"pdserve plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else _table(plan))
    return 0


def _run_search(args: argparse.Namespace) -> int:
    try:
        if args.slo is None:
            raise ValueError("--gpus needs --slo, e.g. --slo ttft=500ms,tpot=50ms")
        model = load_model_spec(args.model, args.dtype)
        if args.calibration:
            hardware = CalibratedHardware(
                Calibration.load(args.calibration),
                kv_bytes_per_token(model),
                args.kv_bandwidth_gbs * GB,
                args.kv_latency_ms / 1e3,
            )
        else:
            hardware = RooflineHardware(
                model,
                _gpu(args),
                args.kv_bandwidth_gbs * GB,
                args.kv_latency_ms / 1e3,
                args.reserve_fraction,
            )
        scenario = Scenario(
            _workload(args),
            Slo.parse(args.slo),
            args.num_requests,
            args.burstiness,
            args.seed,
            args.attainment,
        )
    except (ValueError, OSError) as error:
        print(f"pdserve plan: error: {error}", file=sys.stderr)
        return 2
    progress = Progress(0, "configurations simulated")
    evaluations = search(hardware, scenario, args.gpus, args.rate, progress.at)
    if not evaluations or not evaluations[0].meets_slo:
        print(search_table(evaluations))
        print(
            f"pdserve plan: no configuration of {args.gpus} GPU(s) meets the SLO", file=sys.stderr
        )
        return 1
    best = evaluations[0]
    print(search_table(evaluations))
    print(
        f"recommended: {best.candidate.label}, {best.goodput_per_gpu:.3f} req/s per GPU "
        f"({best.goodput:.2f} req/s on {best.candidate.gpus} GPU(s))"
    )
    memory = {} if args.calibration else pool_memory(best.candidate, model, hardware.gpu)
    for use in memory.values():
        print(f"memory: {use.describe()}")
    if args.write_cluster:
        if args.calibration:
            gpu_type = args.gpu or "cpu"
        else:
            gpu_type = args.gpu or (DEFAULT_GPU if args.gpu_memory_gb is None else "custom")
        kv_cache_gib = {
            role: round(use.kv_cache / GIB) for role, use in memory.items() if use.kv_cache
        }
        write_cluster_file(
            args.write_cluster,
            cluster_document(
                best.candidate, args.model, args.dtype or "auto", gpu_type, kv_cache_gib
            ),
        )
        print(f"wrote {args.write_cluster}")
    return 0


def pool_memory(candidate: Candidate, model: ModelSpec, gpu: GpuSpec) -> dict[str, GpuMemoryUse]:
    """Each pool's GPU memory as `pdserve up` checks it (its default reserve and KV buffers),
    with the most whole GiB of KV cache per GPU that fit: what --write-cluster writes."""
    pools = {Role.DECODE.value: candidate.decode_tp}
    if not candidate.colocated:
        pools = {Role.PREFILL.value: candidate.prefill_tp, **pools}
    return {
        role: gpu_memory_use(
            role,
            model,
            gpu,
            tp,
            kv_cache_gib_that_fits(role, model, gpu, tp) * GIB,
            DEFAULT_SEND_BUFFER_MIB,
        )
        for role, tp in pools.items()
    }


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    input_len = Length.parse(args.input_len or DEFAULT_INPUT_LEN[args.workload])
    output_len = Length.parse(args.output_len)
    if args.workload == "mixed":
        return WorkloadSpec(
            input_len, output_len, args.long_fraction, Length.parse(args.long_input_len)
        )
    return WorkloadSpec(input_len, output_len)


def search_table(evaluations: list[Evaluation]) -> str:
    """One row per configuration, best first; the recommended one is marked with *."""
    header = (
        f"  {'configuration':<22}{'GPUs':>5}{'rate':>9}{'goodput':>9}{'per GPU':>9}"
        f"{'p90 TTFT ms':>13}{'p90 TPOT ms':>13}{'SLO met':>9}"
    )
    lines = [header]
    for rank, evaluation in enumerate(evaluations):
        summary = evaluation.summary
        mark = "*" if rank == 0 and evaluation.meets_slo else " "
        lines.append(
            f"{mark} {evaluation.candidate.label:<22}{evaluation.candidate.gpus:>5}"
            f"{evaluation.rate:>9.2f}{evaluation.goodput:>9.2f}{evaluation.goodput_per_gpu:>9.3f}"
            f"{_ms(summary.ttft.p90):>13}{_ms(summary.tpot.p90):>13}{summary.slo_attainment:>9.0%}"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _gpu(args: argparse.Namespace) -> GpuSpec:
    custom = (args.gpu_memory_gb, args.gpu_bandwidth_gbs, args.gpu_tflops)
    if custom == (None, None, None):
        return gpu_preset(args.gpu or DEFAULT_GPU)
    if args.gpu is not None or None in custom:
        raise ValueError(
            "a custom GPU needs all of --gpu-memory-gb, --gpu-bandwidth-gbs and --gpu-tflops, "
            "and no --gpu"
        )
    return GpuSpec.from_datasheet("custom", *custom)


def _table(plan: CapacityPlan) -> str:
    """The figures, and for a MoE model, an MLA model or a data-parallel group theirs too."""
    tp, dp, ep = plan.tensor_parallel_size, plan.data_parallel_size, plan.expert_parallel_size
    layout = f"{plan.gpu} × {tp} (tensor parallel)"
    if dp > 1:
        layout += f", a group of {dp} data-parallel ranks"
    rows = [
        ("model", plan.model),
        ("GPU", layout + (f", expert parallel over {ep}" if ep > 1 else "")),
        ("weights", f"{_bytes(plan.weight_bytes)}  ({plan.weight_bytes / GB:.2f} GB)"),
    ]
    moe = plan.active_params != plan.total_params
    if moe:
        rows.append(
            (
                "parameters",
                f"{plan.total_params / 1e9:.1f}B, {plan.active_params / 1e9:.1f}B active per "
                "token (compute counts these)",
            )
        )
    if moe or dp > 1:
        rows.append(("weights per GPU", _bytes(plan.weight_bytes_per_gpu)))
    kv_token = f"{_bytes(plan.kv_bytes_per_token)}  ({plan.kv_values_per_token:,} values"
    if plan.kv_bytes_per_token_per_gpu == plan.kv_bytes_per_token and tp > 1:
        kv_token += "; a latent: every TP rank keeps it whole"
    rows += [
        ("KV per token", kv_token + ")"),
        ("KV per request", f"{_bytes(plan.kv_bytes_per_request)}  ({plan.context_tokens} tokens)"),
        ("KV tokens per GPU", f"{plan.kv_tokens_per_gpu:,}"),
        (
            "max concurrent requests",
            f"{plan.max_concurrent_requests}  ({plan.reserve_fraction:.0%} memory reserve"
            + (", per data-parallel rank)" if dp > 1 else ")"),
        ),
        ("decode step ≥", f"{plan.decode_step_lower_bound_ms:.2f} ms  (weights only)"),
        (
            "decode step at batch ≥",
            f"{plan.decode_step_lower_bound_at_batch_ms:.2f} ms  "
            f"({plan.batch_size} × {plan.context_tokens} tokens)",
        ),
        ("prefill ≈", f"{plan.prefill_time_ms:.2f} ms  ({plan.context_tokens}-token prompt)"),
        (
            "KV transfer ≈",
            f"{plan.kv_transfer_ms:.2f} ms  (that prompt's KV into a decode replica like this one)",
        ),
    ]
    if ep > 1:
        rows += [
            (
                "all-to-all per token",
                f"{_bytes(plan.all_to_all_bytes_per_token)}  (all MoE layers)",
            ),
            (
                "all-to-all ≈",
                f"{plan.all_to_all_prefill_ms:.2f} ms per prompt, {plan.all_to_all_decode_ms:.2f} "
                "ms per decode step at batch",
            ),
        ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _bytes(count: float) -> str:
    """Binary units, the way GPU memory and KV blocks are usually counted."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"
