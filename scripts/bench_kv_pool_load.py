"""What one KV pool load costs: two colocated workers with round-robin routing; a history is
computed on one worker, then the history plus a few new tokens goes to the other, which loads
the history from the pool (docs/kv-pool.md).

    python scripts/bench_kv_pool_load.py [--history-tokens 1536] [--pauses 0,0.3,1] [--rounds 6]

Per round and pause: the history (fresh words) goes to worker A, then after the pause the
history plus 32 tokens goes to worker B (a pool load), then the same plus one word to A (its own
prefix cache), then a fresh prompt of the same length to B (nothing cached), then a short one
to A (so the next round starts on A again); each request starts once the one before has ended.
Prints the median TTFT of each, per pause: the pause shows how soon after a request ends its
blocks can be loaded (vLLM stores a step's blocks during the next step).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.local_cluster import local_cluster
from pdserve.bench.workload import PromptText, load_tokenizer
from pdserve.model_store.store import ensure_model
from pdserve.worker.processes import free_port

MODEL = "smollm2"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, default=1536, help="default 1536")
    parser.add_argument("--pauses", default="0,0.3,1", help="seconds, comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="per pause (default 6)")
    parser.add_argument("--log-dir", type=Path, help="default: a new temporary folder")
    args = parser.parse_args()
    text = PromptText(1, load_tokenizer(str(ensure_model(MODEL))))
    serve_args = ["--colocated", "--workers", "2", "--policy", "round-robin"]
    serve_args += ["--kv-cache-gib", "0.5", "--served-model-name", MODEL]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-pool-load-"))
    pauses = [float(pause) for pause in args.pauses.split(",")]
    print(f"history {args.history_tokens} tokens; logs in {log_dir}", file=sys.stderr)
    lines = ["| pause (s) | pool load | own prefix cache | nothing cached |", "|---|---|---|---|"]
    with local_cluster(0, 1, free_port(), log_dir, serve_args) as url:
        for pause in pauses:
            times: dict[str, list[float]] = {"pool": [], "local": [], "fresh": []}
            for _ in range(args.rounds):
                history, new = text.make(args.history_tokens), text.make(32)
                ttft(url, history + " first")  # worker A
                time.sleep(pause)
                times["pool"].append(ttft(url, history + new))  # B
                times["local"].append(ttft(url, history + new + " again"))  # A
                times["fresh"].append(ttft(url, text.make(args.history_tokens) + new))  # B
                ttft(url, text.make(8))  # A: the next round starts on A
            cells = [f"{statistics.median(times[k]) * 1e3:,.0f} ms" for k in times]
            lines.append(f"| {pause:g} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr)
    print(f"TTFT, median of {args.rounds} rounds, {args.history_tokens}-token history")
    print("\n".join(lines))
    return 0


def ttft(url: str, prompt: str) -> float:
    """Seconds from sending a streamed greedy completion to its first text. Returns once the
    stream has ended, so that the next request starts after this one has (its blocks stored,
    nothing of it running)."""
    started = time.perf_counter()
    first = None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


if __name__ == "__main__":
    sys.exit(main())
