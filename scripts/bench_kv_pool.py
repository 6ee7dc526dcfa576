"""KV reuse on and off on multi-turn conversations (or a Mooncake-format trace). Comparisons:

- `--compare pool` (default): the host KV pool (docs/kv-pool.md) off and on, `--workers`
  colocated workers (default 2) with round-robin routing, so a conversation's next turn often
  lands on a worker that did not compute its history (the more workers, the more often);
- `--compare peer`: as `pool`, but with a pool beside each worker (`serve --kv-pool-scope
  worker`, as on Kubernetes), so a later turn's worker fetches the history from the pool of the
  worker that computed it (docs/kv-pool.md#across-hosts);
- `--compare scope`: one 2 GiB pool for the host (off) against a pool of 2 GiB / --workers
  beside each worker, fetching from each other (on): what a pool per pod costs against one a
  node's workers share;
- `--compare decode-reuse`: 1P1D with every prompt disaggregated and no pool, the router's
  policy round-robin (off: the prefill worker sends every block) or cache-aware (on: only the
  blocks the decode worker does not hold from the turn before: docs/architecture.md);
- `--compare decode-pool`: 1P1D with the host KV pool, the route estimate choosing each
  request's path; off: only the prefill worker in the pool (`serve --decode-kv-pool off`), on:
  the decode worker too (it stores its answers, and loads what it computes itself).

    python scripts/bench_kv_pool.py [--compare pool|peer|scope|decode-reuse|decode-pool]
        [--repeats 3]
        [--conversations 12] [--turns 4] [--concurrency 4] [--think-time 1] [--input-len 256]
        [--first-input-len N] [--output-len 32] [--workers 2] [--kv-cache-gib 0.5]
        [--max-model-len N] [--kv-pool-gib G]
        [--trace FILE --trace-block-size 16] [--output-dir DIR] [--output-json FILE]

Each round starts `pdserve serve` in each configuration (its logs under
OUTPUT_DIR/ROUND-off|on/), runs `pdserve bench --workload conversation` (or, with --trace,
`--workload trace --trace-format mooncake` at the trace's own times:
scripts/scale_mooncake_trace.py scales one of Mooncake's traces to this host) against it,
scrapes the workers' pdserve_kv_pool_hits_total and the router's KV bytes per transfer, and
stops it; off and on alternate, and which goes first alternates by round. Every process is
started in its own process group and stopped on every path out (Ctrl-C and SIGTERM included).
Prints a markdown table: per configuration, the median over rounds and [min, max] of TTFT
p50/p90 of three groups of requests, the prefix hit rate, its infinite-cache bound, the pool
hits, the KV received per disaggregated request and failed requests; then the median (and
range) of the per-round ratios TTFT p50 off/on. The groups: for conversations turn 0, turns
>= 1 and turns >= 2; for a trace the requests of which an earlier request had less than half of
the prompt, all of them, and those of which it had at least half (every request of Mooncake's
traces shares a first block). About 1.5 minutes per configuration and round on 2 cores (a
trace: its duration).
"""

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.local_cluster import local_cluster, worker_metrics_urls
from pdserve.bench.metrics import distribution
from pdserve.model_store.store import ensure_model
from pdserve.worker.processes import free_port, log_tail, spawn, stop_group

MODEL = "smollm2"
POOL_HITS = 'pdserve_kv_pool_hits_total{tier="host"}'
KV_BYTES = "pdserve_kv_transfer_bytes"  # the router's histogram, per disaggregated request
ROUTES = re.compile(r'pdserve_route_total\{path="(?P<route>[^"]+)"\} (?P<count>\S+)')
# name: (what it compares, prefill and decode workers, serve's options for both, for off and on)
COMPARISONS = {
    "pool": (
        "colocated workers (--workers), round-robin; the host KV pool off and on",
        (0, 1),
        ["--colocated", "--policy", "round-robin"],
        {"off": ["--kv-pool", "off"], "on": ["--kv-pool", "on"]},
    ),
    "peer": (
        "colocated workers (--workers), round-robin; no KV pool, and a pool beside each worker "
        "(as each Kubernetes pod has), the workers fetching what another's pool holds",
        (0, 1),
        ["--colocated", "--policy", "round-robin"],
        {"off": ["--kv-pool", "off"], "on": ["--kv-pool", "on", "--kv-pool-scope", "worker"]},
    ),
    "scope": (
        "colocated workers (--workers), round-robin; off: one 2 GiB KV pool for the host, on: "
        "a pool of 2 GiB / --workers beside each worker, fetching from each other",
        (0, 1),
        ["--colocated", "--policy", "round-robin"],
        {"off": ["--kv-pool-scope", "host"], "on": ["--kv-pool-scope", "worker"]},
    ),
    "decode-reuse": (
        "1P1D, every prompt disaggregated, no KV pool; off: round-robin (every block sent), "
        "on: cache-aware (only the blocks the decode worker lacks)",
        (1, 1),
        ["--route-policy", "length", "--disaggregate-min-tokens", "0", "--kv-pool", "off"],
        {"off": ["--policy", "round-robin"], "on": ["--policy", "cache-aware"]},
    ),
    "decode-pool": (
        "1P1D, the host KV pool, the route estimate; off: the prefill worker alone in the pool, "
        "on: the decode worker too",
        (1, 1),
        ["--policy", "round-robin"],
        {"off": ["--decode-kv-pool", "off"], "on": ["--decode-kv-pool", "on"]},
    ),
}
GROUPS = {  # the request groups' names, for conversations and for traces
    "conversation": {"first": "turn 0", "later": "turns>=1", "most": "turns>=2"},
    "trace": {"first": "reuse<1/2", "later": "all", "most": "reuse>=1/2"},
}
FIGURES = {  # key: (column title, format); {first}, {later}, {most}: the groups' names
    "ttft_first_p50": ("TTFT {first} p50 ms", "ms"),
    "ttft_first_p90": ("TTFT {first} p90 ms", "ms"),
    "ttft_later_p50": ("TTFT {later} p50 ms", "ms"),
    "ttft_later_p90": ("TTFT {later} p90 ms", "ms"),
    "ttft_most_p50": ("TTFT {most} p50 ms", "ms"),
    "ttft_most_p90": ("TTFT {most} p90 ms", "ms"),
    "prefix_hit_rate": ("prefix hit rate", "%"),
    "infinite_cache_hit_rate": ("infinite-cache bound", "%"),
    "pool_hits": ("pool hits (tokens)", "n"),
    "kv_mib": ("KV MiB per request", "mib"),
    "local": ("local path", "%"),
    "failed": ("failed", "n"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--compare", choices=COMPARISONS, default="pool", help="what is off and on (default pool)")
    add("--repeats", type=int, default=3, help="rounds, each running off and on (default 3)")
    add("--conversations", type=int, default=12, help="conversations per run (default 12)")
    add("--turns", type=int, default=4, help="turns per conversation (default 4)")
    add("--concurrency", type=int, default=4, help="conversations in flight (default 4)")
    add("--think-time", type=float, default=1.0, help="mean s between turns (default 1)")
    add("--input-len", default="256", help="tokens of each new user message (default 256)")
    add("--first-input-len", help="tokens of each first message (default: as --input-len)")
    add("--output-len", default="32", help="tokens of each reply, ignore_eos (default 32)")
    add("--workers", type=int, default=2, help="pool, peer, scope: colocated workers (default 2)")
    add("--kv-cache-gib", type=float, default=0.5, help="each worker's KV cache (default 0.5)")
    add("--max-model-len", type=int, help="each engine's context (default: the model's)")
    add("--kv-pool-gib", type=float, help="each KV pool's memory (default: serve's, 2)")
    add("--seed", type=int, default=0, help="prompts and think times, the same in every run")
    add("--ready-timeout", type=float, default=600, help="s a server may take to start")
    add("--bench-timeout", type=float, default=900, help="s one bench run may take in all")
    add("--request-timeout", type=float, default=300, help="s a request may take (then failed)")
    add("--trace", type=Path, help="a Mooncake-format trace instead of conversations")
    add("--trace-block-size", type=int, default=16, help="its tokens per hash id (default 16)")
    add("--output-dir", type=Path, help="logs and bench JSON (default: a new temporary folder)")
    add("--output-json", type=Path, help="write every run's figures here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks too
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="pdserve-kv-pool-"))
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(MODEL, log=say)
    runs = []
    for number in range(args.repeats):
        for pool in ("off", "on") if number % 2 == 0 else ("on", "off"):
            runs.append(one_run(number, pool, model_dir, output_dir / f"{number}-{pool}", args))
    print(table(runs, args))
    if args.output_json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(
            json.dumps(
                {
                    "config": config,
                    "runs": runs,
                    "ratios": {key: ratios(runs, f"ttft_{key}_p50") for key in ("later", "most")},
                },
                indent=2,
            )
            + "\n"
        )
        say(f"wrote {args.output_json}")
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def one_run(number: int, pool: str, model_dir: Path, folder: Path, args) -> dict:
    """One server with the comparison's configuration `pool` (off or on), one bench run against
    it: the run's figures."""
    name = f"[round {number + 1}/{args.repeats}, {args.compare} {pool}]"
    _, (prefill, decode), every, configs = COMPARISONS[args.compare]
    serve_args = [*every, *configs[pool], "--kv-cache-gib", str(args.kv_cache_gib)]
    if args.compare in ("pool", "peer", "scope"):
        serve_args += ["--workers", str(args.workers)]
    serve_args += ["--served-model-name", MODEL]
    if args.compare == "scope":  # the same memory: the host's pool, or its share per worker
        serve_args += ["--kv-pool-gib", str(2.0 if pool == "off" else 2.0 / args.workers)]
    elif args.kv_pool_gib:
        serve_args += ["--kv-pool-gib", str(args.kv_pool_gib)]
    if args.max_model_len:  # a KV cache too small for the model's whole context needs it
        serve_args += ["--max-model-len", str(args.max_model_len)]
    say(f"{name} starting the server (logs: {folder})")
    started = time.monotonic()
    with local_cluster(prefill, decode, free_port(), folder, serve_args, args.ready_timeout) as url:
        say(f"{name} ready after {time.monotonic() - started:.0f} s; benchmarking ...")
        started = time.monotonic()
        result = folder / "bench.json"
        bench(url, model_dir, result, folder / "bench.log", args)
        hits, router = pool_hits(folder), router_figures(url)
        say(f"{name} bench took {time.monotonic() - started:.0f} s; stopping the server")
    figures = summarize(json.loads(result.read_text())) | {"pool_hits": hits} | router
    errors = errors_in(folder / "bench.log")
    say(
        f"{name} TTFT p50 {ms(figures['ttft_first_p50'])} / {ms(figures['ttft_later_p50'])} / "
        f"{ms(figures['ttft_most_p50'])} ms ({', '.join(groups(args).values())}); hit rate "
        f"{pct(figures['prefix_hit_rate'])}, "
        f"pool hits {hits:.0f}, KV {mib(figures['kv_mib'])} MiB per request, local path "
        f"{pct(figures['local'])}, {figures['failed']} failed"
        + (f"; errors in the bench log: {errors}" if errors else "")
    )
    return {"round": number, "pool": pool, "log_dir": str(folder), "log_errors": errors} | figures


def bench(url: str, model_dir: Path, result: Path, log_path: Path, args) -> None:
    """`pdserve bench` (conversations, or the trace) in its own process group, within a
    deadline."""
    command = [sys.executable, "-m", "pdserve.cli", "bench", "--url", url]
    command += ["--model", MODEL, "--tokenizer", str(model_dir), "--ignore-eos"]
    if args.trace:
        command += ["--workload", "trace", "--trace-format", "mooncake", "--trace", str(args.trace)]
        command += ["--trace-block-size", str(args.trace_block_size), "--endpoint", "completions"]
    else:
        command += ["--workload", "conversation"]
        command += ["--conversations", str(args.conversations), "--turns", str(args.turns)]
        command += ["--concurrency", str(args.concurrency), "--think-time", str(args.think_time)]
        command += ["--input-len", args.input_len, "--output-len", args.output_len]
        if args.first_input_len:
            command += ["--first-input-len", args.first_input_len]
    command += ["--seed", str(args.seed), "--timeout", str(args.request_timeout)]
    command += ["--output-json", str(result), "--no-progress"]
    process = spawn(command, log_path)
    try:
        code = process.wait(timeout=args.bench_timeout)
    except BaseException:
        stop_group(process.pid, 10, process)
        raise
    stop_group(process.pid, 10, process)  # anything it left behind in its group
    if code != 0 or not result.exists():
        raise RuntimeError(f"pdserve bench exited with code {code}{log_tail(log_path)}")


def router_figures(url: str) -> dict:
    """From the router's /metrics: the KV MiB received per disaggregated request (None: there
    was none), and the share of requests its route estimate computed on the decode worker."""
    sums = {"_sum": 0.0, "_count": 0.0}
    routes = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for suffix in sums:
            if line.startswith(KV_BYTES + suffix):
                sums[suffix] += float(line.rsplit(" ", 1)[1])
        if match := ROUTES.match(line):
            routes[match["route"]] = routes.get(match["route"], 0.0) + float(match["count"])
    return {
        "kv_mib": sums["_sum"] / sums["_count"] / 2**20 if sums["_count"] else None,
        "local": routes.get("local", 0.0) / sum(routes.values()) if routes else None,
    }


def pool_hits(log_dir: Path) -> float:
    """The sum of the workers' pool-hit counters (0 for a worker that exports none yet)."""
    total = 0.0
    for url in worker_metrics_urls(log_dir):
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith(POOL_HITS + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


def groups(args) -> dict[str, str]:
    return GROUPS["trace" if args.trace else "conversation"]


def group(request: dict) -> set[str]:
    """The groups a successful request is in (conversation turns, or how much of its prompt an
    infinite cache would hold)."""
    if request["turn"] is not None:
        turn = request["turn"]
        return {"first"} if turn == 0 else {"later"} | ({"most"} if turn >= 2 else set())
    reused = min(request["cacheable_tokens"] or 0, request["input_tokens"])
    return {"later", "most" if 2 * reused >= request["input_tokens"] else "first"}


def summarize(document: dict) -> dict:
    """TTFT of each group (successful requests), hit rates, failed requests."""
    done = [r for r in document["requests"] if r["error"] is None]
    figures = {}
    for name in ("first", "later", "most"):
        ttft = distribution([r["ttft"] for r in done if name in group(r)])
        figures |= {f"ttft_{name}_p50": ttft.p50, f"ttft_{name}_p90": ttft.p90}
    summary = document["summary"]
    return figures | {
        "prefix_hit_rate": summary["prefix_hit_rate"],
        "infinite_cache_hit_rate": summary["infinite_cache_hit_rate"],
        "failed": summary["failed"],
        "requests": summary["num_requests"],
        "request_errors": sorted({r["error"] for r in document["requests"] if r["error"]}),
    }


def errors_in(log_path: Path) -> list[str]:
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if re.search(r"error|traceback|exception", line, re.I)][:5]


def ratios(runs: list[dict], key: str = "ttft_later_p50") -> list[float]:
    """Per round: a figure (TTFT p50 of turns >= 1) with the pool off / with it on."""
    by_round = {(r["round"], r["pool"]): r[key] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    pairs = [(by_round[(n, "off")], by_round[(n, "on")]) for n in rounds]
    return [off / on for off, on in pairs if off is not None and on]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cell(values: list, kind: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    show = {"ms": ms, "%": pct, "mib": mib, "n": lambda v: f"{v:.0f}"}[kind]
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{show(mid)} [{show(low)}, {show(high)}]"


def table(runs: list[dict], args) -> str:
    if args.trace:
        workload = f"the trace {args.trace.name} (blocks of {args.trace_block_size} tokens)"
    else:
        workload = (
            f"{args.conversations} conversations x {args.turns} turns, {args.concurrency} at a "
            f"time, messages {args.input_len} tokens, replies {args.output_len}"
        )
    names = groups(args)
    compared = COMPARISONS[args.compare][0]
    lines = [
        f"{workload}; {compared}; median [min, max] over {args.repeats} rounds",
        "",
        f"| {args.compare} | "
        + " | ".join(title.format(**names) for title, _ in FIGURES.values())
        + " |",
        "|---" * (len(FIGURES) + 1) + "|",
    ]
    for pool in ("off", "on"):
        these = [r for r in runs if r["pool"] == pool]
        cells = [cell([r[key] for r in these], kind) for key, (_, kind) in FIGURES.items()]
        lines.append(f"| {pool} | " + " | ".join(cells) + " |")
    for name in ("later", "most"):
        found = ratios(runs, f"ttft_{name}_p50")
        if found:
            lines.append(
                f"\nTTFT p50 {names[name]}, off/on: {statistics.median(found):.2f} "
                f"[{min(found):.2f}, {max(found):.2f}] (median of per-round ratios)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
