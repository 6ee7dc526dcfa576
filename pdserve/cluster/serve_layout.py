"""`pdserve serve --layout auto --slo ...`: plan this host's layout for the SLO, print the
ranking with each layout's predicted goodput, and start the winner (`--dry-run`: print the
ranking and the layout, start nothing).

What it plans with, in this order:
- a calibration of this host (`--calibration FILE`, else `calibration_file()` if it exists:
  `scripts/validate_simulator.py --write-calibration` makes one): the simulator runs the host's
  layouts with its measured step costs (planner.host_layouts: one colocated worker with every
  core, each prefill:decode split, colocated replicas);
- on a host with GPUs and no calibration, their roofline (`--gpu`, a preset): every split of
  them and every set of colocated replicas, with each pool's tensor-parallel size, as `pdserve
  plan --gpus N` searches them;
- on a CPU host with neither, the reference calibration of the dtype its workers will run
  (`REFERENCE_CALIBRATIONS`: 2 cores, SmolLM2, measured by scripts/validate_simulator.py in
  float32 and in bfloat16, whose steps are far shorter on a CPU with bfloat16 dot products),
  with a line saying so.
The load planned for is planner.host_layouts.HOST_WORKLOAD at `--plan-rate`, or, without one,
each layout at its peak goodput (planner.host_layouts.rank_host_layouts).
"""

import argparse
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.metrics import Slo
from pdserve.core.gpu_spec import GPU_PRESETS, gpu_preset, local_gpus
from pdserve.core.progress import Progress
from pdserve.model_store.store import cache_dir, is_hub_id, resolve_model
from pdserve.planner.calibration import Calibration
from pdserve.planner.command import search_table
from pdserve.planner.host_layouts import (
    HOST_WORKLOAD,
    host_hardware,
    rank_host_layouts,
    ranking_table,
)
from pdserve.planner.model_spec import MODEL_PRESETS, ModelSpec, load_model_spec
from pdserve.planner.search import Candidate, RooflineHardware, Scenario, search
from pdserve.settings.engine import EngineSettings
from pdserve.worker.engine_dtype import engine_dtype

AUTO = "auto"
PLANNER = Path(__file__).parents[1] / "planner"
REFERENCE_CALIBRATIONS = {
    dtype: PLANNER / f"reference_calibration_{dtype}.json" for dtype in ("float32", "bfloat16")
}
# Between the GPUs of one host: NVLink-class (pdserve plan's default, 25 GB/s, is a NIC's).
GPU_KV_BANDWIDTH_BYTES_PER_S, GPU_KV_LATENCY_S = 100e9, 0.001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "automatic layout",
        "--layout auto plans the workers instead of --prefill/--decode/"
        "--colocated/--workers (docs/planner.md)",
    )
    group.add_argument(
        "--layout",
        choices=("given", AUTO),
        default="given",
        help="auto: plan this host's layout for --slo with the planner's simulator and start "
        "the one with the highest predicted goodput; given: the workers the options above say "
        "(default: given)",
    )
    group.add_argument(
        "--slo",
        metavar="OBJECTIVES",
        help='with --layout auto (required): e.g. "ttft=2s,tpot=150ms" (keys ttft, tpot, e2e)',
    )
    group.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="with --layout auto: this host's measured step costs "
        "(default: calibration.json in pdserve's cache folder, $PDSERVE_CACHE or "
        "~/.cache/pdserve, if it exists)",
    )
    group.add_argument(
        "--gpu",
        metavar="PRESET",
        help="with --layout auto on GPUs and no calibration: their type, of "
        f"{', '.join(GPU_PRESETS)}",
    )
    group.add_argument(
        "--plan-rate",
        type=float,
        metavar="REQ_PER_S",
        help="with --layout auto: compare the layouts' goodput at this request rate (default: "
        "each at its peak, the most requests/s meeting the SLO at any rate)",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="with --layout auto: print the ranking and the layout it would start; start nothing",
    )


@dataclass(frozen=True)
class PlannedLayout:
    """The winner, as `pdserve serve`'s worker options."""

    name: str
    colocated: bool
    prefill: int
    decode: int  # decode workers, or colocated ones
    prefill_tp: int | None  # None: what the options said
    decode_tp: int | None

    @property
    def serve_arguments(self) -> list[str]:
        tp = [] if self.decode_tp is None else ["--tensor-parallel-size", str(self.decode_tp)]
        if self.colocated:
            return ["--colocated", "--workers", str(self.decode), *tp]
        if self.prefill_tp is not None and self.prefill_tp != self.decode_tp:
            tp += ["--prefill-tensor-parallel-size", str(self.prefill_tp)]
        return ["--prefill", str(self.prefill), "--decode", str(self.decode), *tp]

    def apply(self, args: argparse.Namespace) -> None:
        args.colocated, args.flex = self.colocated, 0
        args.prefill, args.decode, args.workers = self.prefill, self.decode, self.decode
        if self.decode_tp is not None:
            args.tensor_parallel_size = self.decode_tp
            args.prefill_tensor_parallel_size = self.prefill_tp
        args.prefill_kv_transports = ""


def plan_layout(args: argparse.Namespace, engine: EngineSettings, say=print) -> PlannedLayout:
    """The layout to start for `engine`'s model and dtype, after printing the ranking. Raises
    ValueError for what the options or the files got wrong."""
    if args.slo is None:
        raise ValueError('--layout auto needs --slo, e.g. --slo "ttft=2s,tpot=150ms"')
    if args.colocated or args.flex:
        raise ValueError("--layout auto chooses the workers: leave out --colocated and --flex")
    if args.plan_rate is not None and args.plan_rate <= 0:
        raise ValueError("--plan-rate: must be > 0")
    scenario = Scenario(HOST_WORKLOAD, Slo.parse(args.slo))
    calibration = _calibration_file(args)
    gpus = local_gpus()
    if calibration is None and gpus:
        return _plan_gpus(args, engine.model, gpus, scenario, say)
    path = calibration
    if path is None:
        dtype = engine_dtype(engine.dtype, cpu=True)
        measured_in = dtype if dtype in REFERENCE_CALIBRATIONS else "float32"
        path = REFERENCE_CALIBRATIONS[measured_in]
        say(
            f"no calibration of this host ({calibration_file()}): planning with the reference "
            f"one measured in {measured_in} (this host's workers: {dtype}); `python "
            f"scripts/validate_simulator.py --write-calibration {calibration_file()}` measures "
            "this host's"
        )
    measured = Calibration.load(path)
    say(f"planning with {path}: {measured.model}, {measured.measured_on}")
    hardware = host_hardware(measured)
    progress = Progress(0, "layouts simulated")
    ranked = rank_host_layouts(hardware, scenario, args.plan_rate, progress.at)
    say(ranking_table(ranked))
    best = ranked[0]
    if best.evaluation.goodput == 0:
        raise ValueError(f"no layout of this host serves a request within the SLO {args.slo}")
    layout = best.layout
    return PlannedLayout(layout.name, layout.colocated, layout.prefill, layout.decode, None, None)


def calibration_file() -> Path:
    """Where this host's calibration is looked for."""
    return cache_dir() / "calibration.json"


def _calibration_file(args: argparse.Namespace) -> Path | None:
    if args.calibration is not None:
        return args.calibration
    return calibration_file() if calibration_file().is_file() else None


def _plan_gpus(
    args: argparse.Namespace, model: str, gpus: int, scenario: Scenario, say
) -> PlannedLayout:
    if args.gpu is None:
        raise ValueError(
            f"--layout auto on {gpus} GPU(s) without a calibration needs --gpu, of "
            f"{', '.join(GPU_PRESETS)}"
        )
    hardware = RooflineHardware(
        _model_spec(model),
        gpu_preset(args.gpu),
        GPU_KV_BANDWIDTH_BYTES_PER_S,
        GPU_KV_LATENCY_S,
    )
    say(f"planning {gpus} x {args.gpu} at their roofline (no calibration of this host)")
    progress = Progress(0, "configurations simulated")
    # The whole host serves: the most goodput, not the most per GPU as a plan to buy GPUs by.
    evaluations = sorted(
        search(hardware, scenario, gpus, args.plan_rate, progress.at),
        key=lambda e: (not e.meets_slo, -e.goodput, e.candidate.gpus, e.candidate.label),
    )
    say(search_table(evaluations))
    if not evaluations or not evaluations[0].meets_slo:
        raise ValueError(f"no configuration of {gpus} GPU(s) meets the SLO {args.slo}")
    best: Candidate = evaluations[0].candidate
    return PlannedLayout(
        best.label,
        best.colocated,
        best.prefill_replicas,
        best.decode_replicas,
        best.prefill_tp,
        best.decode_tp,
    )


def _model_spec(model: str) -> ModelSpec:
    """A planner preset by name, else the model's config.json: in its folder, or from the hub
    for an org/name id (the file alone)."""
    if model in MODEL_PRESETS:
        return MODEL_PRESETS[model]
    path = resolve_model(model)
    if is_hub_id(path):
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(path, "config.json")
    return load_model_spec(path)
