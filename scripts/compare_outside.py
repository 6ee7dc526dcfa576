"""pdserve against plain vLLM through an outside client: vLLM's own `vllm bench serve`
(scripts/vllm_bench_serve.py), the same arguments for every system, each system started as
scripts/compare_vllm.py starts it, one at a time, the rounds alternating their order.

    python scripts/compare_outside.py [--systems vllm,colocated] [--repeats 2]
        [--output-dir DIR] [-- BENCH_SERVE_ARGS...]

BENCH_SERVE_ARGS go to `vllm bench serve` as they are (default: DEFAULT_BENCH_ARGS, ~10 short
requests decoding at once); the script adds the server's URL, the model, its tokenizer and
where the result goes. Per run it prints vLLM's client's goodput, TTFT, TPOT and ITL medians,
beside the engines' own mean inter-token latency over the run (pdserve.bench.engine_itl: a gap
there is in the engine's steps, not in the tokens' delivery) and each kind of process's CPU and
context switches (voluntary / involuntary: a front's wake-ups, an engine core's preemptions) per
completed request (pdserve.bench.process_cpu); then, per system, the medians [min, max] over the
rounds and of the per-round ratios to vllm's. Writes OUTPUT_DIR/outside.json (every run's
figures and vLLM's whole result) and each run's logs under OUTPUT_DIR/logs-SYSTEM-ROUND/.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare_vllm, also when imported

from compare_vllm import MODEL, SYSTEMS, interleaved, say, spread

from pdserve.bench import engine_itl, process_cpu
from pdserve.model_store.store import ensure_model

BENCH_SERVE = Path(__file__).resolve().parent / "vllm_bench_serve.py"
DEFAULT_BENCH_ARGS = (
    "--dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 80 "
    "--request-rate 1.5 --ignore-eos --goodput ttft:1000 tpot:100 --seed 0"
).split()
FIGURES = ("request_goodput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")
"""What each run reports of vLLM's result, in this order."""


@dataclass(frozen=True)
class Run:
    """One system in one round: vLLM's client's figures (FIGURES; None where it gave none),
    the engines' own mean ITL (seconds) and each kind of process's CPU ms per completed
    request."""

    system: str
    round: int
    figures: dict[str, float | None]
    completed: int
    failed: int
    engine_itl: float | None
    cpu_ms_per_request: dict[str, float]
    switches_per_request: dict[str, tuple[float, float]]  # (voluntary, involuntary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--systems",
        default="vllm,colocated",
        help=f"comma-separated, run in this order (default vllm,colocated; known: "
        f"{', '.join(SYSTEMS)})",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="rounds, the systems alternating (default 2)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds a system may take to start"
    )
    parser.add_argument("--output-dir", type=Path, help="default: a new temporary folder")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    bench_args = argv[cut + 1 :] or list(DEFAULT_BENCH_ARGS)
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="pdserve-outside-"))
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(MODEL, log=say)
    say(f"vllm bench serve {' '.join(bench_args)}")
    runs, results = [], []
    for run in interleaved(systems, args.repeats, output_dir, model_dir, args.ready_timeout, 300):
        result = bench(run.running, model_dir, bench_args, run.log_dir)
        runs.append(result_run(run.system, run.round, *result))
        results.append(result[0])
        say(f"[{run.name}] {line(runs[-1])}")
    print(summary(runs, systems))
    document = {"bench_args": bench_args, "runs": [asdict(r) for r in runs], "results": results}
    (output_dir / "outside.json").write_text(json.dumps(document, indent=2) + "\n")
    say(f"wrote {output_dir / 'outside.json'}")
    return 0


def bench(running, model_dir: Path, bench_args: list[str], log_dir: Path) -> tuple:
    """`vllm bench serve` against the running system: (its result, the engines' mean ITL, the
    usage by kind of process) over its run. Its output goes to LOG_DIR/bench-serve.log."""
    command = [sys.executable, str(BENCH_SERVE), "--base-url", running.url, "--model", MODEL]
    command += ["--tokenizer", str(model_dir), "--save-result", "--result-dir", str(log_dir)]
    command += ["--result-filename", "bench-serve.json", *bench_args]
    before, itl_before = process_cpu.sample(), engine_itl.totals(running.engine_metrics)
    with open(log_dir / "bench-serve.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    after = process_cpu.sample()
    itl = engine_itl.mean_between(itl_before, engine_itl.totals(running.engine_metrics))
    result = json.loads((log_dir / "bench-serve.json").read_text())
    return result, itl, process_cpu.spent(before, after), process_cpu.switches(before, after)


def result_run(
    system: str, number: int, result: dict, itl, cpu: dict[str, float], switches: dict
) -> Run:
    completed = result.get("completed", 0)
    per = max(1, completed)
    return Run(
        system=system,
        round=number,
        figures={figure: result.get(figure) for figure in FIGURES},
        completed=completed,
        failed=result.get("failed", 0),
        engine_itl=itl,
        cpu_ms_per_request={k: 1e3 * s / per for k, s in cpu.items()},
        switches_per_request={k: (v / per, i / per) for k, (v, i) in switches.items()},
    )


def line(run: Run) -> str:
    figures = ", ".join(f"{k} {_number(v)}" for k, v in run.figures.items())
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in run.cpu_ms_per_request.items())
    switches = ", ".join(f"{k} {v:.0f}/{i:.0f}" for k, (v, i) in run.switches_per_request.items())
    itl = "-" if run.engine_itl is None else f"{1e3 * run.engine_itl:.1f} ms"
    return (
        f"{run.completed} completed, {run.failed} failed; {figures}; engine ITL {itl}; "
        f"CPU ms/request: {cpu}; context switches/request (voluntary/involuntary): {switches}"
    )


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary(runs: list[Run], systems: list[str]) -> str:
    """Per system: each figure's median [min, max] over the rounds and its per-round ratio to
    vllm's; the engines' ITL likewise; CPU ms per request of all its processes."""
    figures = [*FIGURES, "engine_itl_ms", "cpu_ms_per_request"]
    lines = ["| system | " + " | ".join(figures) + " |", "|---" * (len(figures) + 1) + "|"]

    def value(run: Run, figure: str) -> float | None:
        if figure == "engine_itl_ms":
            return None if run.engine_itl is None else 1e3 * run.engine_itl
        if figure == "cpu_ms_per_request":
            return sum(run.cpu_ms_per_request.values())
        return run.figures[figure]

    for system in systems:
        mine = {r.round: r for r in runs if r.system == system}
        vllm = {r.round: r for r in runs if r.system == "vllm"}
        cells = []
        for figure in figures:
            values = [v for r in mine.values() if (v := value(r, figure)) is not None]
            cell = spread(values, ".2f")
            ratios = [
                value(mine[n], figure) / value(vllm[n], figure)
                for n in mine
                if n in vllm and value(mine[n], figure) and value(vllm[n], figure)
            ]
            if system != "vllm" and ratios:
                cell += f", {spread(ratios, '.2f')}×"
            cells.append(cell)
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
