"""Check the simulator against the real cluster on this machine: calibrate the step-time model
on 1 prefill + 1 decode worker (or take a calibration file), predict the goodput of that cluster
at three request rates, measure the same requests with the benchmark, and print both side by
side with the error.

    python scripts/validate_simulator.py [--rates 0.5,1,2] [--num-requests 16] [--slo ...]
        [--workload mixed] [--write-calibration cpu.json | --calibration cpu.json]

Without --rates the three rates are 30%, 70% and 120% of the throughput the calibrated model
says 1P1D can sustain without contention: one at ease, one loaded, one past capacity. Every
request goes disaggregated (--route-policy length --disaggregate-min-tokens 0) on both the real
cluster and the simulated one (whose router otherwise models the runtime's default, the
estimate). The calibration (also what `pdserve plan --calibration` reads) includes how much the
two workers, sharing this host's cores, slow each other. Takes a few minutes and every core.
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
from pdserve.bench.metrics import Slo, Summary, summarize
from pdserve.bench.report import record_json
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.workload import (
    DEFAULT_INPUT_LEN,
    BenchRequest,
    Length,
    PromptText,
    load_tokenizer,
    mixed,
    synthetic,
)
from pdserve.model_store.store import ensure_model
from pdserve.planner.calibration import Calibration, fit_steps
from pdserve.planner.capacity import kv_bytes_per_token
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.planner.search import CalibratedHardware, Candidate, throughput_bound
from pdserve.planner.sim_workload import from_bench
from pdserve.planner.simulator import SimCluster, simulate
from pdserve.worker.processes import free_port

KV_CACHE_GIB = 1
KV_BANDWIDTH_BYTES_PER_S = 0.5e9  # gRPC over loopback, measured here (docs/planner.md)
KV_LATENCY_S = 0.005
CPU_BLOCK_SIZE = 128


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", help="three request rates (req/s); default: from the calibration"
    )
    parser.add_argument(
        "--num-requests", type=int, default=16, help="requests per rate (default 16)"
    )
    parser.add_argument(
        "--workload",
        choices=("synthetic", "mixed"),
        default="synthetic",
        help="synthetic, or mixed: 10%% long prompts (normal:1500,150) among short ones "
        "(default synthetic)",
    )
    parser.add_argument(
        "--input-len",
        help="prompt tokens (default: synthetic 128-384, mixed "
        f"{DEFAULT_INPUT_LEN['mixed']}, the short ones)",
    )
    parser.add_argument("--output-len", default="24", help="output tokens (default 24)")
    parser.add_argument(
        "--slo", default="ttft=1.5s,tpot=200ms", help="default ttft=1.5s,tpot=200ms"
    )
    parser.add_argument("--serve-args", default="", help="more options for pdserve serve")
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="cluster logs and the calibration's requests (default: a new temporary folder)",
    )
    calibration = parser.add_mutually_exclusive_group()
    calibration.add_argument(
        "--write-calibration",
        type=Path,
        metavar="FILE",
        help="also write the calibration measured here (for pdserve plan --calibration)",
    )
    calibration.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="predict with this calibration instead of measuring one",
    )
    args = parser.parse_args()
    slo = Slo.parse(args.slo)
    model_dir = ensure_model("smollm2")
    text = PromptText(0, load_tokenizer(str(model_dir)))
    serve_args = [
        "--kv-cache-gib",
        str(KV_CACHE_GIB),
        "--route-policy",
        "length",
        "--disaggregate-min-tokens",
        "0",
        *args.serve_args.split(),
    ]
    print("starting 1 prefill + 1 decode worker ...", file=sys.stderr, flush=True)
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-validate-"))
    with local_cluster(1, 1, free_port(), args.log_dir, serve_args) as url:
        return asyncio.run(validate(url, args, slo, text))


async def validate(url: str, args, slo: Slo, text: PromptText) -> int:
    async with make_http_client() as http:
        target = Target(url, await first_model(http, url), ignore_eos=True)
    requests = workload(args, text)
    print("warming up ...", file=sys.stderr, flush=True)
    await warm_up(fresh(requests, text), target, min(len(requests), 8))
    if args.calibration:
        calibration = Calibration.load(args.calibration)
    else:
        calibration = await calibrate(target, requests, text, args.log_dir)
        if args.write_calibration:
            calibration.save(args.write_calibration)
            print(f"wrote {args.write_calibration}", file=sys.stderr)
    print(
        f"calibration: prefill = {calibration.prefill_base_s * 1e3:.1f} ms + "
        f"{calibration.prefill_per_token_s * 1e3:.3f} ms/token; "
        f"decode step = {calibration.decode_base_s * 1e3:.1f} ms + "
        f"{calibration.decode_per_request_s * 1e3:.2f} ms/request; contention: prefill "
        f"+{calibration.prefill_contention:.0%}, decode +{calibration.decode_contention:.0%} "
        "per busy neighbour"
    )
    cluster = cpu_cluster(calibration)
    if args.rates:
        rates = [float(rate) for rate in args.rates.split(",")]
    else:
        bound = throughput_bound(cluster, from_bench(requests, [0.0] * len(requests)))
        rates = [round(bound * share, 2) for share in (0.3, 0.7, 1.2)]
    rows = []
    for rate in rates:
        offsets = arrival_times(len(requests), rate, seed=0)
        sent = fresh(requests, text)
        predicted = summarize(*simulate(cluster, from_bench(sent, offsets)), slo)
        print(
            f"measuring {len(requests)} requests at {rate:g} req/s ...", file=sys.stderr, flush=True
        )
        records, duration = await run_benchmark(sent, target, offsets=offsets, progress=False)
        rows.append((rate, predicted, summarize(records, duration, slo)))
    print(comparison_table(rows, args.slo))
    return 0


def workload(args, text: PromptText) -> list[BenchRequest]:
    output_len = Length.parse(args.output_len)
    if args.workload == "mixed":
        short = Length.parse(args.input_len or DEFAULT_INPUT_LEN["mixed"])
        return mixed(
            args.num_requests, 0.1, short, Length.parse("normal:1500,150"), output_len, text
        )
    return synthetic(args.num_requests, Length.parse(args.input_len or "128-384"), output_len, text)


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
    per_token = kv_bytes_per_token(MODEL_PRESETS["smollm2-135m"])
    return Calibration.from_fit(
        fit_steps(entries),
        model="smollm2",
        measured_on=f"{os.cpu_count()} cores, 1 prefill + 1 decode worker (pdserve serve), "
        "scripts/validate_simulator.py",
        workers_per_host=2,
        kv_capacity_tokens=KV_CACHE_GIB * 2**30 // per_token,
        block_size=CPU_BLOCK_SIZE,
    )


def cpu_cluster(calibration: Calibration) -> SimCluster:
    """1P1D of SmolLM2-135M on this machine, as the simulator sees it, its router told what the
    measured one runs with (every prompt disaggregated)."""
    hardware = CalibratedHardware(
        calibration,
        kv_bytes_per_token(MODEL_PRESETS["smollm2-135m"]),
        KV_BANDWIDTH_BYTES_PER_S,
        KV_LATENCY_S,
    )
    cluster = hardware.cluster(Candidate(1, 1, 1, 1))
    return replace(cluster, route_policy="length", disaggregate_min_tokens=0)


def comparison_table(rows: list[tuple[float, Summary, Summary]], slo: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    def error(predicted: float, measured: float) -> str:
        return "-" if measured == 0 else f"{(predicted - measured) / measured:+.0%}"

    lines = [
        f"1P1D, SLO {slo}: predicted (simulator, calibrated) vs measured (pdserve bench)",
        f"{'rate':>6} | {'goodput req/s':^22} | {'SLO met':^13} | "
        f"{'p90 TTFT ms':^15} | {'p90 TPOT ms':^13}",
        f"{'req/s':>6} | {'pred':>7}{'meas':>8}{'error':>7} | {'pred':>6}{'meas':>7} | "
        f"{'pred':>7}{'meas':>8} | {'pred':>6}{'meas':>7}",
    ]
    for rate, predicted, measured in rows:
        lines.append(
            f"{rate:>6.2f} | {predicted.goodput:>7.2f}{measured.goodput:>8.2f}"
            f"{error(predicted.goodput, measured.goodput):>7} | "
            f"{predicted.slo_attainment:>6.0%}{measured.slo_attainment:>7.0%} | "
            f"{ms(predicted.ttft.p90):>7}{ms(measured.ttft.p90):>8} | "
            f"{ms(predicted.tpot.p90):>6}{ms(measured.tpot.p90):>7}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
