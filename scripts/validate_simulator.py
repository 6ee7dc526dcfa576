"""Check the simulator against the real cluster on this machine: calibrate the step-time model
on 1 prefill + 1 decode worker, predict the goodput of that cluster at three request rates,
measure the same requests with the benchmark, and print both side by side.

    python scripts/validate_simulator.py [--rates 0.5,1,2] [--num-requests 16] [--slo ...]

Without --rates the three rates are 30%, 70% and 120% of the throughput the calibrated model
says 1P1D can sustain: one at ease, one loaded, one past capacity. Every request goes
disaggregated (--disaggregate-min-tokens 0), as the simulator is told. Takes a few minutes.
"""

import argparse
import asyncio
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.arrivals import arrival_times
from bench.client import Target, first_model, make_http_client
from bench.local_cluster import local_cluster
from bench.metrics import Slo, Summary, summarize
from bench.report import record_json
from bench.runner import run as run_benchmark
from bench.runner import warm_up
from bench.workload import BenchRequest, Length, PromptText, load_tokenizer, synthetic
from model_store.store import ensure_model
from planner.calibration import fit_linear_cost
from planner.capacity import kv_bytes_per_token
from planner.cost_model import LinearCost
from planner.model_spec import MODEL_PRESETS
from planner.search import throughput_bound
from planner.sim_workload import from_bench
from planner.simulator import SimCluster, simulate
from worker.processes import free_port

KV_CACHE_GIB = 1
KV_BANDWIDTH_BYTES_PER_S = 0.5e9  # gRPC over loopback, measured here (DESIGN.md)
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
    parser.add_argument("--input-len", default="128-384", help="prompt tokens (default 128-384)")
    parser.add_argument("--output-len", default="24", help="output tokens (default 24)")
    parser.add_argument(
        "--slo", default="ttft=1.5s,tpot=200ms", help="default ttft=1.5s,tpot=200ms"
    )
    parser.add_argument("--serve-args", default="", help="more options for pdserve serve")
    parser.add_argument(
        "--log-dir", type=Path, help="cluster logs (default: a new temporary folder)"
    )
    args = parser.parse_args()
    slo = Slo.parse(args.slo)
    model_dir = ensure_model("smollm2")
    text = PromptText(0, load_tokenizer(str(model_dir)))
    serve_args = [
        "--kv-cache-gib",
        str(KV_CACHE_GIB),
        "--disaggregate-min-tokens",
        "0",
        *args.serve_args.split(),
    ]
    print("starting 1 prefill + 1 decode worker ...", file=sys.stderr, flush=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-validate-"))
    with local_cluster(1, 1, free_port(), log_dir, serve_args) as url:
        return asyncio.run(validate(url, args, slo, text))


async def validate(url: str, args, slo: Slo, text: PromptText) -> int:
    async with make_http_client() as http:
        target = Target(url, await first_model(http, url), ignore_eos=True)
    requests = synthetic(
        args.num_requests, Length.parse(args.input_len), Length.parse(args.output_len), text
    )
    print("warming up ...", file=sys.stderr, flush=True)
    await warm_up(requests, target, len(requests))
    cost = await calibrate(target, requests)
    print(
        f"calibrated: prefill = {cost.prefill_base_s * 1e3:.1f} ms + "
        f"{cost.prefill_per_token_s * 1e3:.3f} ms/token; "
        f"decode step = {cost.decode_base_s * 1e3:.1f} ms + "
        f"{cost.decode_per_request_s * 1e3:.2f} ms/request"
    )
    cluster = cpu_cluster(cost)
    if args.rates:
        rates = [float(rate) for rate in args.rates.split(",")]
    else:
        bound = throughput_bound(cluster, from_bench(requests, [0.0] * len(requests)))
        rates = [round(bound * share, 2) for share in (0.3, 0.7, 1.2)]
    rows = []
    for rate in rates:
        offsets = arrival_times(len(requests), rate, seed=0)
        predicted = summarize(*simulate(cluster, from_bench(requests, offsets)), slo)
        print(
            f"measuring {len(requests)} requests at {rate:g} req/s ...", file=sys.stderr, flush=True
        )
        records, duration = await run_benchmark(requests, target, offsets=offsets, progress=False)
        rows.append((rate, predicted, summarize(records, duration, slo)))
    print(comparison_table(rows, args.slo))
    return 0


async def calibrate(target: Target, workload: list[BenchRequest]) -> LinearCost:
    """Two short benchmark runs on the workload's own prompts, so the step times are fitted over
    the lengths and contexts they will predict (a line fitted over 64..960-token prompts
    overestimated the middle: prefill cost is convex in length): eight sent one at a time with 4
    output tokens (prefill), then two bursts of eight with 4..32 output tokens (decode: the batch
    shrinks 8 → 1)."""
    lone = [replace(request, max_tokens=4) for request in workload[:8]]
    bursts = [replace(workload[i % len(workload)], max_tokens=4 * (i % 8 + 1)) for i in range(16)]
    print("calibrating ...", file=sys.stderr, flush=True)
    runs = [
        await run_benchmark(lone, target, concurrency=1, progress=False),
        await run_benchmark(bursts, target, offsets=[0.0] * 8 + [8.0] * 8, progress=False),
    ]
    entries = []
    for records, _ in runs:
        start = min(r.send_time for r in records)
        entries.append([record_json(r, start) for r in records])
    return fit_linear_cost(entries)


def cpu_cluster(cost: LinearCost) -> SimCluster:
    """1P1D of SmolLM2-135M on this machine, as the simulator sees it."""
    per_token = kv_bytes_per_token(MODEL_PRESETS["smollm2-135m"])
    return SimCluster(
        prefill_replicas=1,
        decode_replicas=1,
        prefill_cost=cost,
        decode_cost=cost,
        kv_capacity_tokens=KV_CACHE_GIB * 2**30 // per_token,
        kv_bytes_per_token=per_token,
        kv_bandwidth_bytes_per_s=KV_BANDWIDTH_BYTES_PER_S,
        kv_latency_s=KV_LATENCY_S,
        block_size=CPU_BLOCK_SIZE,
    )


def comparison_table(rows: list[tuple[float, Summary, Summary]], slo: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    lines = [
        f"1P1D, SLO {slo}: predicted (simulator, calibrated) vs measured (pdserve bench)",
        f"{'rate':>6} | {'goodput req/s':^15} | {'SLO met':^13} | "
        f"{'p90 TTFT ms':^15} | {'p90 TPOT ms':^13}",
        f"{'req/s':>6} | {'pred':>7}{'meas':>8} | {'pred':>6}{'meas':>7} | "
        f"{'pred':>7}{'meas':>8} | {'pred':>6}{'meas':>7}",
    ]
    for rate, predicted, measured in rows:
        lines.append(
            f"{rate:>6.2f} | {predicted.goodput:>7.2f}{measured.goodput:>8.2f} | "
            f"{predicted.slo_attainment:>6.0%}{measured.slo_attainment:>7.0%} | "
            f"{ms(predicted.ttft.p90):>7}{ms(measured.ttft.p90):>8} | "
            f"{ms(predicted.tpot.p90):>6}{ms(measured.tpot.p90):>7}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
