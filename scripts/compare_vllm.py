"""pdserve against plain vLLM on the same cores: the same workload at the same rates through
pdserve's bench code, one system at a time, in one table.

    python scripts/compare_vllm.py [--workload mixed|long-prompt|agentic] [--rates 0.5,1,1.5]
        [--num-requests 60] [--repeats 3] [--slo "ttft=2s,tpot=150ms;ttft=1s,tpot=100ms"]
        [--output-dir compare] [--systems vllm,vllm-defaults,colocated,1p1d]

Systems (each started in its own process group, stopped by its PID before the next starts; by
default vllm, vllm-defaults, colocated and 1p1d, the others when named):
- vllm: `python -m vllm.entrypoints.openai.api_server`, the same model in the dtype a pdserve
  worker runs here (`--dtype auto`: bfloat16 on a CPU with bfloat16 dot products, float32
  without), eager, 1 GiB of KV cache, as many OpenMP threads as a lone pdserve worker gets
  (every core), no binding: the best configuration of vLLM found on this host;
- vllm-bound: vllm with its compute threads pinned to the cores as colocated's are
  (VLLM_CPU_OMP_THREADS_BIND, `pdserve serve --cpu-binding auto`'s split for one worker);
- vllm-defaults: vLLM as its users start it (`vllm serve MODEL`): its own dtype (bfloat16 for
  SmolLM2), torch.compile, KV cache size and OpenMP binding (one core kept for its front end);
- vllm-nixl: vLLM's own P/D: two such servers with vLLM's
  NixlConnector (UCX on CPU; needs `pip install 'pdserve[vllm-nixl]'`), the prefill server's
  compute threads on the first core and the decode server's on the second, as 1p1d's workers,
  behind scripts/vllm_pd_proxy.py (vLLM's toy proxy protocol: prefill with max_tokens 1, then
  decode with the prefill reply's kv_transfer_params);
- colocated: `pdserve serve --colocated` (one worker that prefills and decodes);
- colocated-float32: the same with `--dtype float32` (the default before `auto`);
- colocated-2: `pdserve serve --colocated --workers 2` (two such workers, a core each: data
  parallel on the cores 1P1D splits; its lone request is a colocated worker's on one core);
- 1p1d: `pdserve serve --prefill 1 --decode 1` with its default routing;
- 1p1d-local: the same, every prompt prefilled on the decode worker (--route-policy length,
  --disaggregate-min-tokens past any prompt);
- 1p1d-disaggregated: the same, every prompt through the prefill worker (--route-policy length,
  --disaggregate-min-tokens 0);
- 1p1d-length: the same, prompts of 256 tokens or more disaggregated (the old default);
- 1p1d-unbound: 1p1d with --cpu-binding none (the OS places every thread; 1p1d's default here,
  auto, pins each worker's compute threads to its own core);
- colocated-no-pool, 1p1d-no-pool: colocated and 1p1d with --kv-pool off;
- colocated-unbound: colocated with --cpu-binding none (the OS places every thread, as vllm's);
- 1p1d-decode-no-pool: 1p1d with the decode worker out of the KV pool (--decode-kv-pool off).
Workload: `pdserve bench`'s, built by its own option code: `mixed` (the default: 90% ~100-token
prompts, 10% ~1,500-token prompts (--long-fraction), 64 output tokens), or a named one
(bench.presets: `long-prompt`, long prompts and short answers with no reuse, where P/D should
win; `agentic`, chats resending a long history, its control, --num-requests conversations per
rate, --rates conversations started per second); ignore_eos, Poisson arrivals; the same
requests and arrival times for every system at a rate, other prompts at each rate (no
prefix-cache hit from the rate before). --rates, --slo and --output-len default to the
workload's own.
Before the rates, each system gets LONE_REQUESTS lone long prompts, one at a time: the table's
last column is their median inter-token latency from the third token on and the gap between
the first and second token (the hand-off, on the disaggregated path).
--repeats N runs every system N times, the systems alternating (each round in the reverse order
of the one before), so that a slow spell of the host falls on all of them; --slo takes several
SLOs (';'-separated), each scored on the same requests. Prints each run's table, then per SLO,
system and rate the median goodput with its [min, max] over the rounds and the median of the
per-round ratios to vllm's (when vllm ran), and each system's hand-off gap in ITLs; then where
each system's CPU went while a rate ran, by kind of process (router, workers, engine cores, KV
pool store, fork server; vLLM's API server and engine core): CPU ms per completed request and
cores (pdserve.bench.process_cpu); and, beside each run's client TPOT, the inter-token latency
its engines themselves gave (vLLM's histogram of engine-core timestamps,
pdserve.bench.engine_itl): a gap to vllm there is in the engine's steps, not in the delivery of
the tokens. Writes OUTPUT_DIR/compare.json (every row's figures and full summary) and each run's
logs under OUTPUT_DIR/logs-SYSTEM-ROUND/.
"""

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench import conversation, engine_itl, process_cpu
from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Target
from pdserve.bench.conversation import Conversation
from pdserve.bench.local_cluster import local_cluster, served, vllm_server, worker_metrics_urls
from pdserve.bench.metrics import Slo, Summary, distribution, summarize
from pdserve.bench.options import (
    add_benchmark_arguments,
    build_conversations,
    build_requests,
    check_arguments,
)
from pdserve.bench.presets import PRESETS
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.workload import BenchRequest, PromptText, load_tokenizer
from pdserve.cluster.local_workers import core_shares
from pdserve.model_store.store import ensure_model
from pdserve.worker.engine_process import OMP_BIND_ENV, core_ids, openmp_binding
from pdserve.worker.processes import free_port

MODEL = "smollm2"
KV_CACHE_GIB = 1
LONG_PROMPT_TOKENS = 800  # between the short (~100) and the long (~1,500) prompts
LONE_REQUESTS, LONE_PROMPT_TOKENS, LONE_OUTPUT_TOKENS = 3, 1536, 64
STOP_GRACE_S = 60
ALWAYS_LOCAL_TOKENS = 1_000_000  # past any prompt: every one prefilled on its decode worker
WARMUP_REQUESTS = 4
WORKLOAD_DEFAULTS = {
    "mixed": ("0.5,1,1.5", "ttft=2s,tpot=150ms", 64),
    "long-prompt": ("0.15,0.3", PRESETS["long-prompt"].values["slo"], None),
    "agentic": ("0.1,0.2", PRESETS["agentic"].values["slo"], None),
}
"""Per workload: --rates, --slo and --output-len when not given (None: the preset's)."""
VLLM_SYSTEMS = {
    "vllm": {},
    "vllm-defaults": {"defaults": True},
    "vllm-bound": {
        "more_env": {OMP_BIND_ENV: core_shares([1], sorted(os.sched_getaffinity(0)))[0]}
    },
}
"""Plain vLLM servers: vllm_server's options for each (see the module's docstring)."""
SYSTEMS = {
    **dict.fromkeys(VLLM_SYSTEMS),
    "vllm-nixl": None,
    "colocated": (0, 1, ["--colocated"]),
    "colocated-float32": (0, 1, ["--colocated", "--dtype", "float32"]),
    "colocated-2": (0, 1, ["--colocated", "--workers", "2"]),
    "colocated-no-pool": (0, 1, ["--colocated", "--kv-pool", "off"]),
    "colocated-unbound": (0, 1, ["--colocated", "--cpu-binding", "none"]),
    "1p1d": (1, 1, []),
    "1p1d-local": (
        1,
        1,
        ["--route-policy", "length", "--disaggregate-min-tokens", str(ALWAYS_LOCAL_TOKENS)],
    ),
    "1p1d-disaggregated": (1, 1, ["--route-policy", "length", "--disaggregate-min-tokens", "0"]),
    "1p1d-length": (1, 1, ["--route-policy", "length"]),
    "1p1d-unbound": (1, 1, ["--cpu-binding", "none"]),
    "1p1d-no-pool": (1, 1, ["--kv-pool", "off"]),
    "1p1d-decode-no-pool": (1, 1, ["--decode-kv-pool", "off"]),
    "1p1d-with-prefill": (1, 1, ["--decode-admission", "with-prefill"]),
}
"""How `pdserve serve` starts each pdserve system: (prefill, decode, more options); None: a
vLLM system."""
DEFAULT_SYSTEMS = ["vllm", "vllm-defaults", "colocated", "1p1d"]
"""The comparison itself: vLLM tuned and as its users start it, pdserve's two layouts here. The
other systems are variants, for the question each answers, run when named."""
NIXL_KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
PROXY = Path(__file__).resolve().parent / "vllm_pd_proxy.py"


@dataclass(frozen=True)
class Row:
    """One system at one rate in one round: the table's figures (seconds; None without
    samples); goodput and SLO attainment per SLO, by its text."""

    system: str
    round: int
    rate: float
    goodput: dict[str, float]
    slo_attainment: dict[str, float]
    ttft_short_p50: float | None
    ttft_short_p90: float | None
    ttft_long_p50: float | None
    ttft_long_p90: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    prefix_hit_rate: float | None  # served from a prefix cache; None: the server did not say
    failed: int
    lone_itl_p50: float | None  # a lone long request: median gap before tokens 3, 4, ...
    lone_first_gap: float | None  # ... and between its first and second token
    engine_itl: float | None  # the engines' own mean inter-token latency over the rate's run
    cpu_ms_per_request: dict[str, float]  # each kind of process's CPU over the rate's run, per
    cores: dict[str, float]  # completed request, and in cores (CPU seconds over the run's)


@dataclass
class Lone:
    """LONE_REQUESTS long prompts sent one at a time on an idle system, before the rates: how
    fast one request decodes with nothing else running (issue 14's decode-worker ITL and
    hand-off gap; on the disaggregated path the first token is the prefill worker's)."""

    itl_p50: float | None
    first_gap: float | None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=tuple(WORKLOAD_DEFAULTS),
        default="mixed",
        help="pdserve bench's workload (default mixed)",
    )
    defaults = ", ".join(f"{name} {value[0]}" for name, value in WORKLOAD_DEFAULTS.items())
    parser.add_argument("--rates", help=f"request rates (default: {defaults})")
    parser.add_argument(
        "--num-requests",
        type=int,
        default=60,
        help="requests per rate (agentic: conversations) (default 60)",
    )
    defaults = ", ".join(f"{name} {value[1]}" for name, value in WORKLOAD_DEFAULTS.items())
    parser.add_argument("--slo", help=f"objectives, several separated by ';' (default: {defaults})")
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds, the systems alternating (default 1)"
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, run in this order (default {','.join(DEFAULT_SYSTEMS)}; "
        f"also: {', '.join(name for name in SYSTEMS if name not in DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        help=f"output tokens (default: mixed {WORKLOAD_DEFAULTS['mixed'][2]}, a named workload "
        "its own)",
    )
    parser.add_argument(
        "--long-fraction",
        type=float,
        default=0.1,
        help="mixed: share of ~1,500-token prompts (default 0.1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals")
    parser.add_argument(
        "--ready-timeout", type=float, default=600, help="seconds a system may take to start"
    )
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds a request may take (then failed)"
    )
    parser.add_argument(
        "--output-dir", type=Path, help="compare.json and logs (default: a new temporary folder)"
    )
    args = parser.parse_args()
    default_rates, default_slo, default_output_len = WORKLOAD_DEFAULTS[args.workload]
    args.rates = args.rates or default_rates
    args.slo = args.slo or default_slo
    args.output_len = args.output_len or default_output_len
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    if "vllm-nixl" in systems and importlib.util.find_spec("nixl") is None:
        say(
            "compare_vllm.py: vllm-nixl needs NIXL, not installed: "
            f"{sys.executable} -m pip install 'nixl==1.5.1' (pyproject.toml's vllm-nixl extra)"
        )
        return 2
    rates = [float(rate) for rate in args.rates.split(",")]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    slos = {text: Slo.parse(text) for text in args.slo.split(";")}
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="pdserve-compare-"))
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(MODEL, log=say)
    # A workload of its own per rate (and one for the warm-up and lone requests): a prompt seen
    # at an earlier rate would be a prefix-cache hit at the next.
    workloads = [workload(args, model_dir, args.seed + number) for number in range(len(rates) + 1)]
    text = PromptText(args.seed + len(rates) + 1, load_tokenizer(str(model_dir)))
    lone = [
        BenchRequest(LONE_PROMPT_TOKENS, LONE_OUTPUT_TOKENS, prompt=text.make(LONE_PROMPT_TOKENS))
        for _ in range(LONE_REQUESTS)
    ]
    rows, summaries = [], []
    runs = interleaved(
        systems, args.repeats, output_dir, model_dir, args.ready_timeout, args.timeout
    )
    for run in runs:
        alone, results = asyncio.run(
            measure(run.name, run.running, workloads, lone, rates, slos, args)
        )
        for rate, records, summary, cpu, itl, duration in results:
            rows.append(
                row(run.system, run.round, rate, records, summary, alone, cpu, itl, duration)
            )
            summaries.append({text: asdict(one) for text, one in summary.items()})
    print(table(args.workload, rows))
    print(rounds_table(rows, systems, rates, list(slos)))
    print(cpu_table(rows, systems, rates))
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": [asdict(r) | {"summary": s} for r, s in zip(rows, summaries, strict=True)],
    }
    (output_dir / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {output_dir / 'compare.json'}")
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Workload:
    """One seed's workload as `pdserve bench` builds it: its requests, or its conversations and
    warm-up requests that share no text with them; the endpoint it goes to."""

    requests: list[BenchRequest]
    talks: list[Conversation] | None
    endpoint: str


def workload(args: argparse.Namespace, tokenizer_dir: Path | None, seed: int) -> Workload:
    """`pdserve bench --workload WORKLOAD` at `seed`, through bench's own options and builders;
    prompts sized with the tokenizer of `tokenizer_dir` (None: about a token per word)."""
    talks = args.workload != "mixed" and PRESETS[args.workload].generator == "conversation"
    argv = ["--workload", args.workload, "--seed", str(seed)]
    argv += ["--tokenizer", str(tokenizer_dir)] if tokenizer_dir else []
    argv += ["--warmup", str(WARMUP_REQUESTS), "--long-fraction", str(args.long_fraction)]
    argv += ["--conversations" if talks else "--num-requests", str(args.num_requests)]
    if args.output_len:
        argv += ["--output-len", str(args.output_len)]
    bench = argparse.ArgumentParser()
    add_benchmark_arguments(bench)
    options = bench.parse_args(argv)
    check_arguments(options)
    if talks:
        conversations, warmups = build_conversations(options)
        return Workload(warmups, conversations, options.endpoint)
    return Workload(build_requests(options), None, options.endpoint)


@dataclass(frozen=True)
class Running:
    """A system while it runs: its base URL, and the /metrics of every engine it runs."""

    url: str
    engine_metrics: list[str]


@dataclass(frozen=True)
class SystemRun:
    """One system in one round, while it runs: its name in the progress lines, where its logs
    go, and the system."""

    system: str
    round: int
    name: str
    log_dir: Path
    running: Running


def interleaved(
    systems: list[str],
    repeats: int,
    output_dir: Path,
    model_dir: Path,
    ready_timeout_s: float,
    request_timeout_s: float,
) -> Iterator[SystemRun]:
    """Every system in every round, one at a time, each round in the reverse order of the one
    before (a slow spell of the host falls on all of them): yields each while it runs, its logs
    under OUTPUT_DIR/logs-SYSTEM-ROUND/, and stops it before the next starts."""
    for number in range(repeats):
        for system in systems if number % 2 == 0 else systems[::-1]:
            name = f"{system}, round {number + 1}/{repeats}"
            log_dir = output_dir / f"logs-{system}-{number}"
            say(f"[{name}] starting (logs: {log_dir})")
            started = time.monotonic()
            with serving(system, model_dir, log_dir, ready_timeout_s, request_timeout_s) as running:
                say(f"[{name}] ready after {time.monotonic() - started:.0f} s")
                yield SystemRun(system, number, name, log_dir, running)
            say(f"[{name}] stopped")


@contextmanager
def serving(
    system: str, model_dir: Path, log_dir: Path, ready_timeout_s: float, request_timeout_s: float
) -> Iterator[Running]:
    """Yields the system while `system` runs; stops it (its whole process group) on the way
    out, whatever happened."""
    if system in VLLM_SYSTEMS:
        with plain_vllm(model_dir, log_dir, ready_timeout_s, **VLLM_SYSTEMS[system]) as url:
            yield Running(url, [f"{url}/metrics"])
        return
    if system == "vllm-nixl":
        with vllm_disaggregated(model_dir, log_dir, ready_timeout_s, request_timeout_s) as running:
            yield running
        return
    prefill, decode, options = SYSTEMS[system]
    serve_args = ["--kv-cache-gib", str(KV_CACHE_GIB), "--served-model-name", MODEL, *options]
    with local_cluster(prefill, decode, free_port(), log_dir, serve_args, ready_timeout_s) as url:
        yield Running(url, worker_metrics_urls(log_dir))


def plain_vllm(model_dir: Path, log_dir: Path, ready_timeout_s: float, **options):
    """`vllm_server` on this script's model, name and KV cache, on a free port."""
    return vllm_server(
        model_dir, log_dir, ready_timeout_s, MODEL, KV_CACHE_GIB * 2**30, free_port(), **options
    )


@contextmanager
def vllm_disaggregated(
    model_dir: Path, log_dir: Path, ready_timeout_s: float, request_timeout_s: float
) -> Iterator[Running]:
    """vLLM's own P/D: a prefill and a decode server with NixlConnector, each with its compute
    threads on its own core (1p1d's split, one OpenMP thread each) and its own NIXL side-channel
    port, and scripts/vllm_pd_proxy.py in front; yields the proxy's URL (and both servers'
    metrics). Started one after the other (each ready before the next starts), stopped in
    reverse order."""
    cores = core_shares([1, 1], sorted(os.sched_getaffinity(0)))
    with ExitStack() as stack:
        urls = []
        for name, share in zip(("prefill", "decode"), cores, strict=True):
            env = openmp_binding(core_ids(share))
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())  # one per server
            server = plain_vllm(
                model_dir,
                log_dir,
                ready_timeout_s,
                name=name,
                more_args=("--kv-transfer-config", json.dumps(NIXL_KV_CONFIG)),
                more_env=env,
            )
            urls.append(stack.enter_context(server))
        port = free_port()
        command = [sys.executable, str(PROXY), "--port", str(port), "--prefill", urls[0]]
        command += ["--decode", urls[1], "--timeout", str(request_timeout_s)]
        proxy = served(command, log_dir / "proxy.log", port, "vllm_pd_proxy.py", ready_timeout_s)
        yield Running(stack.enter_context(proxy), [f"{url}/metrics" for url in urls])


async def measure(
    system: str,
    running: Running,
    workloads: list[Workload],
    lone: list[BenchRequest],
    rates: list[float],
    slos: dict[str, Slo],
    args: argparse.Namespace,
) -> tuple[Lone, list[tuple]]:
    """The lone requests, then each rate's: (rate, its records, its summary under every SLO, the
    CPU by kind of process, the engines' mean ITL, its duration)."""
    target = Target(running.url, MODEL, workloads[-1].endpoint, ignore_eos=True)
    await warm_up(workloads[-1].requests, target, WARMUP_REQUESTS, args.timeout)
    records, _ = await run_benchmark(
        lone, target, concurrency=1, timeout=args.timeout, progress=False
    )
    gaps = [r.itl for r in records if r.ok and len(r.itl) >= 2]
    alone = Lone(
        distribution([statistics.median(itl[1:]) for itl in gaps]).p50,
        distribution([itl[0] for itl in gaps]).p50,
    )
    say(
        f"[{system}] a lone {LONE_PROMPT_TOKENS}-token request: ITL p50 {_ms(alone.itl_p50)} ms "
        f"from its third token on, first-to-second token {_ms(alone.first_gap)} ms"
    )
    results = []
    for rate, load in zip(rates, workloads, strict=False):
        jobs = load.requests if load.talks is None else load.talks
        offsets = arrival_times(len(jobs), rate, seed=args.seed)
        say(f"[{system}] {len(jobs)} {'requests' if load.talks is None else 'chats'} at {rate:g}/s")
        schedule = {
            "offsets": offsets,
            "timeout": args.timeout,
            "max_duration": offsets[-1] + args.timeout,
            "progress": False,
        }
        before, itl_before = process_cpu.sample(), engine_itl.totals(running.engine_metrics)
        if load.talks is None:
            records, duration = await run_benchmark(load.requests, target, **schedule)
        else:
            records, duration = await conversation.run(load.talks, target, **schedule)
        cpu = process_cpu.spent(before, process_cpu.sample())
        itl = engine_itl.mean_between(itl_before, engine_itl.totals(running.engine_metrics))
        summary = {text: summarize(records, duration, slo) for text, slo in slos.items()}
        say(
            f"[{system}] {rate:g}/s: goodput "
            + ", ".join(f"{s.goodput:.2f} req/s ({text})" for text, s in summary.items())
            + f", {next(iter(summary.values())).failed} failed"
        )
        results.append((rate, records, summary, cpu, itl, duration))
    return alone, results


def row(
    system: str,
    number: int,
    rate: float,
    records: list[RequestRecord],
    summaries: dict[str, Summary],
    alone: Lone,
    cpu: dict[str, float],
    itl: float | None,
    duration: float,
) -> Row:
    done = [r for r in records if r.ok]
    summary = next(iter(summaries.values()))  # the figures that do not depend on the SLO
    short = distribution([r.ttft for r in done if r.prompt_tokens < LONG_PROMPT_TOKENS])
    long = distribution([r.ttft for r in done if r.prompt_tokens >= LONG_PROMPT_TOKENS])
    return Row(
        system=system,
        round=number,
        rate=rate,
        goodput={text: s.goodput for text, s in summaries.items()},
        slo_attainment={text: s.slo_attainment for text, s in summaries.items()},
        ttft_short_p50=short.p50,
        ttft_short_p90=short.p90,
        ttft_long_p50=long.p50,
        ttft_long_p90=long.p90,
        tpot_p50=summary.tpot.p50,
        tpot_p99=summary.tpot.p99,
        prefix_hit_rate=summary.prefix_hit_rate,
        failed=summary.failed,
        lone_itl_p50=alone.itl_p50,
        lone_first_gap=alone.first_gap,
        engine_itl=itl,
        cpu_ms_per_request={
            kind: 1e3 * seconds / max(1, len(done)) for kind, seconds in cpu.items()
        },
        cores={kind: seconds / duration for kind, seconds in cpu.items()},
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def table(workload: str, rows: list[Row]) -> str:
    """Every run's figures; goodput and SLO met under the first SLO."""
    ms = _ms
    first = next(iter(rows[0].goodput))
    lines = [
        f"{workload} workload, goodput and SLO met for {first}; TTFT and TPOT in ms",
        f"{'system':<20}{'round':>6}{'rate':>6}{'goodput':>9}{'SLO met':>9}{'failed':>8}"
        f"{'TTFT short p50/p90':>20}{'TTFT long p50/p90':>20}{'TPOT p50/p99':>15}"
        f"{'engine ITL':>11}{'prefix hit':>11}{'lone ITL/1st gap':>18}",
    ]
    for r in rows:
        lines.append(
            f"{r.system:<20}{r.round + 1:>6}{r.rate:>6g}{r.goodput[first]:>9.2f}"
            f"{r.slo_attainment[first]:>9.0%}{r.failed:>8}"
            f"{ms(r.ttft_short_p50) + ' / ' + ms(r.ttft_short_p90):>20}"
            f"{ms(r.ttft_long_p50) + ' / ' + ms(r.ttft_long_p90):>20}"
            f"{ms(r.tpot_p50) + ' / ' + ms(r.tpot_p99):>15}{ms(r.engine_itl):>11}"
            f"{'-' if r.prefix_hit_rate is None else format(r.prefix_hit_rate, '.0%'):>11}"
            f"{ms(r.lone_itl_p50) + ' / ' + ms(r.lone_first_gap):>18}"
        )
    return "\n".join(lines)


def rounds_table(rows: list[Row], systems: list[str], rates: list[float], slos: list[str]) -> str:
    """Per SLO, system and rate: goodput's median [min, max] over the rounds and the median
    [min, max] of its per-round ratio to vllm's; per system and rate, the client's TPOT p50 and
    the engines' own inter-token latency, and the latter's ratio to vllm's; then each system's
    hand-off (first-to-second token gap of a lone request) in its own inter-token latencies,
    median over the rounds."""

    def goodputs(system: str, rate: float, slo: str) -> dict[int, float]:
        return {r.round: r.goodput[slo] for r in rows if (r.system, r.rate) == (system, rate)}

    lines = ["| SLO | system | rate | goodput (req/s) | / vllm's |", "|---|---|---|---|---|"]
    for slo in slos:
        for system in systems:
            for rate in rates:
                mine, vllm = goodputs(system, rate, slo), goodputs("vllm", rate, slo)
                ratios = [mine[n] / vllm[n] for n in mine if vllm.get(n)]
                lines.append(
                    f"| {slo} | {system} | {rate:g} | {spread(list(mine.values()), '.2f')} | "
                    f"{spread(ratios, '.2f') if system != 'vllm' else '-'} |"
                )
    lines += [
        "",
        "| system | rate | TPOT p50 (ms) | engine ITL (ms) | engine ITL / vllm's |",
        "|---|---|---|---|---|",
    ]
    for system in systems:
        for rate in rates:
            mine = {r.round: r for r in rows if (r.system, r.rate) == (system, rate)}
            vllm = {r.round: r for r in rows if (r.system, r.rate) == ("vllm", rate)}
            tpots = [1e3 * r.tpot_p50 for r in mine.values() if r.tpot_p50]
            itls = [1e3 * r.engine_itl for r in mine.values() if r.engine_itl]
            ratios = [
                mine[n].engine_itl / vllm[n].engine_itl
                for n in mine
                if mine[n].engine_itl and n in vllm and vllm[n].engine_itl
            ]
            lines.append(
                f"| {system} | {rate:g} | {spread(tpots, '.0f')} | {spread(itls, '.0f')} | "
                f"{spread(ratios, '.2f') if system != 'vllm' else '-'} |"
            )
    lines += ["", "| system | hand-off / ITL (lone request) |", "|---|---|"]
    for system in systems:
        handoffs = {
            r.round: r.lone_first_gap / r.lone_itl_p50
            for r in rows
            if r.system == system and r.lone_first_gap and r.lone_itl_p50
        }
        lines.append(f"| {system} | {spread(list(handoffs.values()), '.2f')} |")
    return "\n".join(lines)


def spread(values: list[float], form: str) -> str:
    """'median [min, max]' of `values` in format `form`; '-' for none."""
    if not values:
        return "-"
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:{form}} [{low:{form}}, {high:{form}}]"


def cpu_table(rows: list[Row], systems: list[str], rates: list[float]) -> str:
    """Per system and rate, where its CPU went while the rate ran (pdserve.bench.process_cpu):
    each kind of process's CPU per completed request and in cores, medians over the rounds;
    the total last."""
    lines = [
        "| system | rate | process | CPU ms / request | cores |",
        "|---|---|---|---|---|",
    ]
    for system in systems:
        for rate in rates:
            mine = [r for r in rows if (r.system, r.rate) == (system, rate)]
            kinds = list(dict.fromkeys(kind for r in mine for kind in r.cores))
            for kind in [*kinds, "total"]:
                per_request = _median_of([r.cpu_ms_per_request for r in mine], kind)
                cores = _median_of([r.cores for r in mine], kind)
                lines.append(f"| {system} | {rate:g} | {kind} | {per_request:.1f} | {cores:.2f} |")
    return "\n".join(lines)


def _median_of(figures: list[dict[str, float]], kind: str) -> float:
    """The median over rounds of one kind of process's figure ("total": all kinds summed)."""
    return statistics.median(
        sum(f.values()) if kind == "total" else f.get(kind, 0.0) for f in figures
    )


if __name__ == "__main__":
    sys.exit(main())
