"""The layouts of one host that `pdserve serve --layout auto` chooses among, each simulated with
the host's calibration (planner.calibration) and ranked by goodput for an SLO.

A host calibrated with `workers_per_host` = W workers (each with 1/W of its cores) can run:
- one colocated worker alone, with every core (the calibration's `alone_*` step costs);
- each prefill:decode split of W workers (1P1D on a 2-worker host), disaggregated;
- W colocated replicas, each prefilling its own prompts.
Unlike `pdserve plan --gpus N`, which ranks by goodput per GPU, every layout here uses the whole
host, so they are ranked by goodput.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.bench.workload import DEFAULT_INPUT_LEN, Length
from pdserve.planner.calibration import Calibration
from pdserve.planner.capacity import kv_bytes_per_token
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.planner.search import (
    CalibratedHardware,
    Candidate,
    Evaluation,
    Scenario,
    throughput_bound,
)
from pdserve.planner.sim_workload import WorkloadSpec
from pdserve.planner.simulator import SimCluster

# What --layout auto plans for, and scripts/validate_simulator.py measures by default: bench's
# mixed workload (short prompts, a tenth of them ~1.5K tokens), 64 output tokens.
HOST_WORKLOAD = WorkloadSpec(
    Length.parse(DEFAULT_INPUT_LEN["mixed"]),
    Length.parse("64"),
    0.1,
    Length.parse("normal:1500,150"),
)

# The KV transfer between two workers of one host: gRPC over loopback streamed 64 MiB at
# 0.35-0.65 GB/s here in <= 1 MiB chunks (docs/planner.md).
HOST_KV_BANDWIDTH_BYTES_PER_S = 0.5e9
HOST_KV_LATENCY_S = 0.005


def host_hardware(calibration: Calibration) -> CalibratedHardware:
    """A calibrated host serving SmolLM2-135M (the model the calibrations here measure)."""
    return CalibratedHardware(
        calibration,
        kv_bytes_per_token(MODEL_PRESETS["smollm2-135m"]),
        HOST_KV_BANDWIDTH_BYTES_PER_S,
        HOST_KV_LATENCY_S,
    )


@dataclass(frozen=True)
class HostLayout:
    """`prefill` prefill and `decode` decode workers, or with `colocated` `decode` colocated
    workers; `alone` when one worker has the whole host."""

    prefill: int
    decode: int
    colocated: bool

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        if self.colocated:
            return "colocated" if self.decode == 1 else f"{self.decode} x colocated"
        return f"{self.prefill}P{self.decode}D"

    @property
    def serve_arguments(self) -> list[str]:
        """`pdserve serve`'s options for this layout."""
        if self.colocated:
            return ["--colocated", "--workers", str(self.decode)]
        return ["--prefill", str(self.prefill), "--decode", str(self.decode)]

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.prefill, 1, self.decode, 1)


def host_layouts(workers_per_host: int) -> list[HostLayout]:
    """One colocated worker, every split of the host's workers, the colocated replicas."""
    splits = [HostLayout(p, workers_per_host - p, False) for p in range(1, workers_per_host)]
    replicas = [HostLayout(0, workers_per_host, True)] if workers_per_host > 1 else []
    return [HostLayout(0, 1, True), *splits, *replicas]


def layout_cluster(layout: HostLayout, hardware: CalibratedHardware) -> SimCluster:
    """The simulated cluster of a layout: a lone worker has the host's cores to itself."""
    cluster = hardware.cluster(layout.candidate)
    if layout.workers == 1:
        cost = hardware.calibration.alone_cost
        return replace(cluster, prefill_cost=cost, decode_cost=cost, workers_per_host=1)
    return cluster


@dataclass(frozen=True)
class RankedLayout:
    layout: HostLayout
    evaluation: Evaluation  # its run at the rate it is compared at


PEAK_SHARES = tuple(0.15 * step for step in range(1, 9))  # of a layout's throughput bound


def rank_host_layouts(
    hardware: CalibratedHardware,
    scenario: Scenario,
    rate: float | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> list[RankedLayout]:
    """The host's layouts, best first: by goodput (requests/s meeting the SLO) at `rate`, or
    without one at each layout's peak: the most goodput over rates from 15% of its
    throughput bound to past it (`PEAK_SHARES`). A peak, not the highest rate at which 90% of
    requests meet the SLO: on one core a ~1.5K-token prompt alone misses a 2 s TTFT, so a tenth
    of the requests can miss it at any rate and that rate would not exist. Ties go to fewer
    workers."""
    layouts = host_layouts(hardware.calibration.workers_per_host)
    ranked = []
    for done, layout in enumerate(layouts, start=1):
        cluster = layout_cluster(layout, hardware)
        if rate is not None:
            rates = [rate]
        else:
            bound = throughput_bound(
                cluster, scenario.workload.requests(scenario.num_requests, 1.0, seed=scenario.seed)
            )
            rates = [bound * share for share in PEAK_SHARES]
        runs = []
        for run_rate in rates:
            summary = scenario.run(cluster, run_rate)
            runs.append(Evaluation(layout.candidate, run_rate, summary, scenario.meets(summary)))
        ranked.append(RankedLayout(layout, max(runs, key=lambda e: e.goodput)))
        progress(done, len(layouts))
    return sorted(ranked, key=lambda r: (-r.evaluation.goodput, r.layout.workers, r.layout.name))


def ranking_table(ranked: list[RankedLayout]) -> str:
    """One row per layout, best first (the chosen one marked with *): the rate it is compared
    at, its goodput there and the share of requests meeting the SLO."""
    lines = [
        f"  {'layout':<15}{'rate':>8}{'goodput':>9}{'p90 TTFT ms':>13}{'p90 TPOT ms':>13}"
        f"{'SLO met':>9}"
    ]
    for position, row in enumerate(ranked):
        summary, evaluation = row.evaluation.summary, row.evaluation
        mark = "*" if position == 0 and evaluation.goodput > 0 else " "
        lines.append(
            f"{mark} {row.layout.name:<15}{evaluation.rate:>8.2f}{evaluation.goodput:>9.2f}"
            f"{_ms(summary.ttft.p90):>13}{_ms(summary.tpot.p90):>13}{summary.slo_attainment:>9.0%}"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
