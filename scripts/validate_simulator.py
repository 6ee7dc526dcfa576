"""Check the planner's simulator against the real cluster on this machine, for the layouts
`pdserve serve --layout auto` chooses among: calibrate the step-time model (1 prefill + 1 decode
worker sharing the host, then one colocated worker alone on it), then for each layout (one
colocated worker with every core, 1P1D, two colocated workers) predict the goodput at three
request rates and measure it with the benchmark, under two SLOs (TTFT-bound and TPOT-bound,
from the same requests), and print predicted, measured, the error and whether the layouts rank
the same.

    python scripts/validate_simulator.py [--rates 0.5,1,1.5] [--num-requests 60]
        [--slos "ttft=2s,tpot=150ms;ttft=1s,tpot=100ms"] [--layouts colocated,1P1D,2xcolocated]
        [--write-calibration FILE | --calibration FILE] [--output-json FILE]

The measured clusters run `pdserve serve`'s defaults (the `estimate` path choice, round-robin,
after-prefill admission, the KV pool), as the simulator models them. Without --rates the three
rates are 30%, 70% and 120% of the throughput the calibrated model says 1P1D can sustain
without contention: one at ease, one loaded, one past capacity. Each layout and rate sends the
same requests (the same lengths, in new words, so no prompt hits a prefix cache) at the same
times. Takes 15-25 minutes and every core; the tables go to stdout, progress to stderr.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Target, first_model, make_http_client
from pdserve.bench.local_cluster import local_cluster
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.records import RequestRecord
from pdserve.bench.report import record_json
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.workload import BenchRequest, PromptText, load_tokenizer, mixed
from pdserve.model_store.store import ensure_model
from pdserve.planner.calibration import Calibration, FittedSteps, fit_steps
from pdserve.planner.capacity import kv_bytes_per_token
from pdserve.planner.host_layouts import (
    HOST_WORKLOAD,
    HostLayout,
    host_hardware,
    host_layouts,
    layout_cluster,
)
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.planner.search import CalibratedHardware, throughput_bound
from pdserve.planner.sim_workload import from_bench
from pdserve.planner.simulator import simulate
from pdserve.worker.engine_dtype import AUTO, engine_dtype
from pdserve.worker.processes import free_port

KV_CACHE_GIB = 1
CPU_BLOCK_SIZE = 128
WORKERS_PER_HOST = 2
SLOS = "ttft=2s,tpot=150ms;ttft=1s,tpot=100ms"  # TTFT-bound; TPOT-bound (issue tables)
LAYOUTS = {layout.name.replace(" ", ""): layout for layout in host_layouts(WORKERS_PER_HOST)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", help="request rates (req/s); default: from the calibration")
    parser.add_argument(
        "--num-requests", type=int, default=60, help="requests per layout and rate (default 60)"
    )
    parser.add_argument("--slos", default=SLOS, help=f"SLOs separated by ';' (default {SLOS!r})")
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help=f"layouts to check, of {', '.join(LAYOUTS)} (default all)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="cluster logs and the calibration's requests (default: a new temporary folder)",
    )
    parser.add_argument(
        "--output-json",
        type=Path,
        help="write the cells (layout, rate, slo, predicted, measured, error) here "
        "(scripts/simulator_validation_*.json: one run in each dtype)",
    )
    calibration = parser.add_mutually_exclusive_group()
    calibration.add_argument(
        "--write-calibration",
        type=Path,
        metavar="FILE",
        help="also write the calibration measured here (for pdserve plan and serve --layout auto)",
    )
    calibration.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="predict with this calibration instead of measuring one",
    )
    args = parser.parse_args()
    slos = [(text, Slo.parse(text)) for text in args.slos.split(";")]
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"--layouts: unknown {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    layouts = [LAYOUTS[name] for name in args.layouts.split(",")]
    model_dir = ensure_model("smollm2")
    text = PromptText(0, load_tokenizer(str(model_dir)))
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-validate-"))
    requests = mixed(
        args.num_requests,
        HOST_WORKLOAD.long_fraction,
        HOST_WORKLOAD.input_len,
        HOST_WORKLOAD.long_input_len,
        HOST_WORKLOAD.output_len,
        text,
    )
    if args.calibration:
        calibration = Calibration.load(args.calibration)
    else:
        calibration = measure_calibration(requests, text, args.log_dir)
        if args.write_calibration:
            calibration.save(args.write_calibration)
            say(f"wrote {args.write_calibration}")
    print(describe(calibration))
    hardware = host_hardware(calibration)
    if args.rates:
        rates = [float(rate) for rate in args.rates.split(",")]
    else:
        split = layout_cluster(LAYOUTS["1P1D"], hardware)
        bound = throughput_bound(split, from_bench(requests, [0.0] * len(requests)))
        rates = [round(bound * share, 2) for share in (0.3, 0.7, 1.2)]
    cells = []
    for layout in layouts:
        cells += measure_layout(layout, hardware, requests, rates, slos, text, args.log_dir)
    rank_cells(cells)
    for slo_text, _ in slos:
        print(comparison_table([c for c in cells if c["slo"] == slo_text], slo_text))
    if args.output_json:
        args.output_json.write_text(json.dumps(cells, indent=2) + "\n")
        say(f"wrote {args.output_json}")
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serve_arguments(layout: HostLayout) -> list[str]:
    return ["--kv-cache-gib", str(KV_CACHE_GIB), *layout.serve_arguments]


def measure_calibration(requests: list[BenchRequest], text: PromptText, log_dir: Path):
    """The step costs of 1P1D's workers sharing the host (every prompt disaggregated, so each
    worker's steps are its role's) and of one colocated worker alone on it."""
    split_arguments = ["--route-policy", "length", "--disaggregate-min-tokens", "0"]
    shared = asyncio.run(
        calibrated_steps(
            [*serve_arguments(LAYOUTS["1P1D"]), *split_arguments], requests, text, log_dir / "1P1D"
        )
    )
    alone = asyncio.run(
        calibrated_steps(
            serve_arguments(LAYOUTS["colocated"]), requests, text, log_dir / "colocated"
        )
    )
    per_token = kv_bytes_per_token(MODEL_PRESETS["smollm2-135m"])
    return Calibration.from_fit(
        shared,
        alone,
        model="smollm2",
        measured_on=f"{os.cpu_count()} cores, {engine_dtype(AUTO, cpu=True)}: 1 prefill + 1 "
        "decode worker, and 1 colocated worker alone (pdserve serve), "
        "scripts/validate_simulator.py",
        workers_per_host=WORKERS_PER_HOST,
        kv_capacity_tokens=KV_CACHE_GIB * 2**30 // per_token,
        block_size=CPU_BLOCK_SIZE,
    )


async def calibrated_steps(
    serve_args: list[str], requests: list[BenchRequest], text: PromptText, log_dir: Path
) -> FittedSteps:
    say(f"calibrating on pdserve serve {' '.join(serve_args)} (logs: {log_dir}) ...")
    with local_cluster(0, 1, free_port(), log_dir, serve_args) as url:
        target = await target_at(url)
        await warm_up(fresh(requests, text), target, min(len(requests), 8))
        return await calibrate(target, requests, text, log_dir)


async def target_at(url: str) -> Target:
    async with make_http_client() as http:
        return Target(url, await first_model(http, url), ignore_eos=True)


def measure_layout(
    layout: HostLayout,
    hardware: CalibratedHardware,
    requests: list[BenchRequest],
    rates: list[float],
    slos: list[tuple[str, Slo]],
    text: PromptText,
    log_dir: Path,
) -> list[dict]:
    """A cell per rate and SLO: the layout's predicted and measured goodput."""
    cluster = layout_cluster(layout, hardware)
    folder = log_dir / layout.name.replace(" ", "")
    say(f"{layout.name}: starting pdserve serve {' '.join(serve_arguments(layout))} ...")
    cells = []
    with local_cluster(0, 1, free_port(), folder, serve_arguments(layout)) as url:
        target = asyncio.run(target_at(url))
        asyncio.run(warm_up(fresh(requests, text), target, min(len(requests), 8)))
        for rate in rates:
            offsets = arrival_times(len(requests), rate, seed=0)
            sent = fresh(requests, text)
            predicted = simulate(cluster, from_bench(sent, offsets))
            say(f"{layout.name}: measuring {len(sent)} requests at {rate:g} req/s ...")
            measured = asyncio.run(run_benchmark(sent, target, offsets=offsets, progress=False))
            for slo_text, slo in slos:
                cells.append(cell(layout, rate, slo_text, slo, predicted, measured))
    return cells


def cell(
    layout: HostLayout,
    rate: float,
    slo_text: str,
    slo: Slo,
    predicted: tuple[list[RequestRecord], float],
    measured: tuple[list[RequestRecord], float],
) -> dict:
    guess, seen = summarize(*predicted, slo), summarize(*measured, slo)
    return {
        "layout": layout.name,
        "rate": rate,
        "slo": slo_text,
        "predicted": round(guess.goodput, 4),
        "measured": round(seen.goodput, 4),
        "error": error(guess.goodput, seen.goodput),
        "predicted_attainment": round(guess.slo_attainment, 4),
        "measured_attainment": round(seen.slo_attainment, 4),
        **{
            f"{side}_{figure}_p90_s": round(getattr(summary, figure).p90 or 0.0, 4)
            for side, summary in (("predicted", guess), ("measured", seen))
            for figure in ("ttft", "tpot")
        },
        "measured_failed": sum(not record.ok for record in measured[0]),
    }


def error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; 0 when both are 0, None when only measured is."""
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return round((predicted - measured) / measured, 4)


def rank_cells(cells: list[dict]) -> None:
    """Adds to each cell its layout's rank among the layouts at the same rate and SLO, by
    predicted and by measured goodput (1 = best), and whether the two rankings are equal."""
    for key in {(c["rate"], c["slo"]) for c in cells}:
        group = [c for c in cells if (c["rate"], c["slo"]) == key]
        for figure in ("predicted", "measured"):
            for rank, c in enumerate(sorted(group, key=lambda c: -c[figure]), start=1):
                c[f"rank_{figure}"] = rank
        same = all(c["rank_predicted"] == c["rank_measured"] for c in group)
        for c in group:
            c["ranking_matches"] = same


def describe(calibration: Calibration) -> str:
    shared, alone = calibration.cost, calibration.alone_cost
    return (
        f"calibration, {calibration.workers_per_host} workers sharing the host: prefill = "
        f"{shared.prefill_base_s * 1e3:.1f} ms + {shared.prefill_s_per_token * 1e3:.3f} ms/token; "
        f"decode step = {shared.decode_base_s * 1e3:.1f} ms + "
        f"{shared.decode_s_per_sequence * 1e3:.2f} ms/request; contention: prefill "
        f"+{calibration.prefill_contention:.0%}, decode +{calibration.decode_contention:.0%} "
        "per busy neighbour\n"
        f"calibration, one worker alone: prefill = {alone.prefill_base_s * 1e3:.1f} ms + "
        f"{alone.prefill_s_per_token * 1e3:.3f} ms/token; decode step = "
        f"{alone.decode_base_s * 1e3:.1f} ms + {alone.decode_s_per_sequence * 1e3:.2f} ms/request"
    )


def fresh(requests: list[BenchRequest], text: PromptText) -> list[BenchRequest]:
    """The same lengths in new words: a prompt sent before would hit the workers' prefix
    cache and prefill in a fraction of its time (seen: 63 ms for 257 tokens, 0.4 s fresh)."""
    renewed = []
    for request in requests:
        prompt = text.make(request.prompt_tokens)
        renewed.append(replace(request, prompt=prompt, prompt_tokens=text.count(prompt)))
    return renewed


async def calibrate(
    target: Target, workload: list[BenchRequest], text: PromptText, log_dir: Path
) -> Calibration:
    """Three short benchmark runs on the workload's lengths, in fresh words (no prefix-cache
    hit), so the step times are fitted over the lengths and contexts they will predict (a line
    fitted over 64..960-token prompts overestimated the middle: prefill cost is convex in
    length): eight prompts spread over the workload's lengths, shortest to longest, sent one at
    a time with 4 output tokens (prefill); two bursts of eight with 4..32 output tokens (decode:
    the batch shrinks 8 → 1); and four prompts sent one at a time while other requests decode
    (both workers busy at once: how much they slow each other on this host's shared cores)."""
    by_length = sorted(workload, key=lambda request: request.prompt_tokens)
    spread = [by_length[round(i * (len(by_length) - 1) / 7)] for i in range(8)]
    lone = [replace(request, max_tokens=4) for request in spread]
    bursts = [replace(workload[i % len(workload)], max_tokens=4 * (i % 8 + 1)) for i in range(16)]
    arriving = [replace(request, max_tokens=4) for request in spread[1::2]]
    # Each prompt arrives 1 s after two requests began decoding 96 tokens, and the next pair
    # waits until it had time to finish even at ~4 ms/token (seen 2.7 alone, more contended).
    gap = 2.0 + max(request.prompt_tokens for request in arriving) * 0.004
    overlap, offsets = [], []
    for i, request in enumerate(arriving):
        overlap += [replace(by_length[0], max_tokens=96)] * 2 + [request]
        offsets += [i * gap, i * gap, i * gap + 1.0]
    print("calibrating ...", file=sys.stderr, flush=True)
    runs = [
        await run_benchmark(fresh(lone, text), target, concurrency=1, progress=False),
        await run_benchmark(
            fresh(bursts, text), target, offsets=[0.0] * 8 + [8.0] * 8, progress=False
        ),
        await run_benchmark(fresh(overlap, text), target, offsets=offsets, progress=False),
    ]
    entries = []
    for records, _ in runs:
        start = min(r.send_time for r in records)
        entries.append([record_json(r, start) for r in records])
    (log_dir / "calibration-runs.json").write_text(json.dumps(entries))  # what was fitted
    return fit_steps(entries)


def comparison_table(cells: list[dict], slo: str) -> str:
    """Per layout and rate: goodput predicted and measured, the error, and the ranks."""

    def signed(value: float | None) -> str:
        return "-" if value is None else f"{value:+.0%}"

    lines = [
        f"SLO {slo}: goodput (req/s meeting it) predicted by the simulator vs measured",
        f"{'layout':<14}{'rate':>6} | {'pred':>6}{'meas':>7}{'error':>7} | "
        f"{'met pred':>9}{'meas':>6} | {'rank pred':>9}{'meas':>5} | {'failed':>6}",
    ]
    for c in sorted(cells, key=lambda c: (c["rate"], c["rank_measured"])):
        lines.append(
            f"{c['layout']:<14}{c['rate']:>6.2f} | {c['predicted']:>6.2f}{c['measured']:>7.2f}"
            f"{signed(c['error']):>7} | {c['predicted_attainment']:>9.0%}"
            f"{c['measured_attainment']:>6.0%} | {c['rank_predicted']:>9}{c['rank_measured']:>5} | "
            f"{c['measured_failed']:>6}"
        )
    rates = sorted({c["rate"] for c in cells})
    matches = [all(c["ranking_matches"] for c in cells if c["rate"] == r) for r in rates]
    errors = [abs(c["error"]) for c in cells if c["error"] is not None]
    lines.append(
        f"ranking as measured at {sum(matches)} of {len(rates)} rates; "
        f"error within 15% in {sum(e <= 0.15 for e in errors)} of {len(cells)} cells"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
