"""`pdserve plan`: capacity figures for one model replica on one GPU type.

The prefill:decode ratio search (`--gpus N --workload --slo`) will add its options to this
sub-command and build on `plan_capacity`.
"""

import argparse
import json
import sys
from dataclasses import asdict

from planner.capacity import DEFAULT_RESERVE_FRACTION, CapacityPlan, plan_capacity
from planner.gpu_spec import GB, GPU_PRESETS, GpuSpec, gpu_preset
from planner.model_spec import DTYPE_BYTES, MODEL_PRESETS, load_model_spec

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
        help=f"a preset ({', '.join(MODEL_PRESETS)}) or the path of an HF config.json or its folder",
    )
    parser.add_argument(
        "--gpu", metavar="PRESET", help=f"{', '.join(GPU_PRESETS)} (default {DEFAULT_GPU})"
    )
    custom = parser.add_argument_group("custom GPU", "give all three instead of --gpu")
    custom.add_argument("--gpu-memory-gb", type=_positive_float, metavar="GB",
                        help="GPU memory in GB (decimal)")
    custom.add_argument("--gpu-bandwidth-gbs", type=_positive_float, metavar="GB_PER_S",
                        help="memory bandwidth in GB/s")
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
    parser.add_argument("--tensor-parallel-size", type=_positive_int, default=1, metavar="TP",
                        help="GPUs one replica spans; divides weights and KV (default 1)")
    parser.add_argument(
        "--reserve-fraction",
        type=_fraction,
        default=DEFAULT_RESERVE_FRACTION,
        help=f"GPU memory kept back from weights and KV cache (default {DEFAULT_RESERVE_FRACTION}, "
        "as vLLM's gpu_memory_utilization 0.9)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_capacity(
            load_model_spec(args.model, args.dtype),
            _gpu(args),
            context_tokens=args.context_tokens,
            batch_size=args.batch,
            tensor_parallel_size=args.tensor_parallel_size,
            reserve_fraction=args.reserve_fraction,
        )
    except (ValueError, OSError) as error:
        print(f"pdserve plan: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else _table(plan))
    return 0


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
    rows = (
        ("model", plan.model),
        ("GPU", f"{plan.gpu} × {plan.tensor_parallel_size} (tensor parallel)"),
        ("weights", f"{_bytes(plan.weight_bytes)}  ({plan.weight_bytes / GB:.2f} GB)"),
        ("KV per token", _bytes(plan.kv_bytes_per_token)),
        ("KV per request", f"{_bytes(plan.kv_bytes_per_request)}  ({plan.context_tokens} tokens)"),
        (
            "max concurrent requests",
            f"{plan.max_concurrent_requests}  ({plan.reserve_fraction:.0%} memory reserve)",
        ),
        ("decode step ≥", f"{plan.decode_step_lower_bound_ms:.2f} ms  (weights only)"),
        (
            "decode step at batch ≥",
            f"{plan.decode_step_lower_bound_at_batch_ms:.2f} ms  "
            f"({plan.batch_size} × {plan.context_tokens} tokens)",
        ),
        ("prefill ≈", f"{plan.prefill_time_ms:.2f} ms  ({plan.context_tokens}-token prompt)"),
    )
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _bytes(count: float) -> str:
    """Binary units, the way GPU memory and KV blocks are usually counted."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"
