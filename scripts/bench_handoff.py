"""The hand-off on the disaggregated path, side by side on running pdserve routers: a lone long
request's first-to-second token gap in its own inter-token latencies (ITL).

    python scripts/bench_handoff.py --trees /tmp/main-export,.   # two clusters it starts
    python scripts/bench_handoff.py --urls http://127.0.0.1:8000,http://127.0.0.1:8001

`--trees`: one 1P1D cluster per pdserve source tree (started in the tree with its code on
PYTHONPATH, this Python; `--serve-args` adds flags to each), e.g.
`git archive main | tar -x -C /tmp/main-export` against this checkout, all running at once
(each ~6 GB with its 0.5 GiB KV caches), stopped on every path out. `--urls`: running routers,
each of a 1P1D cluster started as those are (`pdserve serve --prefill 1 --decode 1
--route-policy length --disaggregate-min-tokens 0`: every prompt through the prefill worker), so
the first token is the prefill worker's and the second the decode worker's first step. Each
round sends one request to each router in turn (the order reversed every other round), one at
a time: a fresh prompt of --prompt-tokens tokens, streamed, --output-len tokens (ignore_eos).
Prints per router the medians over the rounds of the first-to-second gap, the ITL from the third
token on, and each request's gap over its own ITL (the hand-off in ITLs, as the table of
scripts/compare_vllm.py has it, whose lone requests are 3 per system).
"""

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.client import Target
from pdserve.bench.local_cluster import served
from pdserve.bench.runner import run as run_benchmark
from pdserve.bench.runner import warm_up
from pdserve.bench.workload import BenchRequest, PromptText, load_tokenizer
from pdserve.model_store.store import ensure_model
from pdserve.worker.processes import free_port

MODEL = "smollm2"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--urls", help="running routers' base URLs, comma-separated")
    where.add_argument("--trees", help="pdserve source trees, one cluster each, comma-separated")
    parser.add_argument("--requests", type=int, default=10, help="lone requests per router")
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--model", default=MODEL, help="the served model name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--serve-args", default="", help="more `pdserve serve` flags for --trees' clusters"
    )
    args = parser.parse_args()
    text = PromptText(args.seed, load_tokenizer(str(ensure_model(MODEL))))
    with contextlib.ExitStack() as stack:
        if args.urls:
            urls = args.urls.split(",")
        else:
            urls = [
                stack.enter_context(cluster(Path(tree), args.model, shlex.split(args.serve_args)))
                for tree in args.trees.split(",")
            ]
            names = dict(zip(urls, args.trees.split(","), strict=True))
        gaps = asyncio.run(measure(urls, text, args))
    if args.trees:
        gaps = {names[url]: values for url, values in gaps.items()}
        urls = [names[url] for url in urls]
    print(f"lone {args.prompt_tokens}-token requests, {args.output_len} tokens each; medians")
    print(f"{'router':<28} {'n':>3} {'1st->2nd ms':>12} {'ITL ms':>7} {'hand-off / ITL':>15}")
    for url in urls:
        first = [gap[0] for gap in gaps[url]]
        itl = [statistics.median(gap[1:]) for gap in gaps[url]]
        ratio = [f / i for f, i in zip(first, itl, strict=True)]
        print(
            f"{url:<28} {len(first):>3} {statistics.median(first) * 1e3:>12.1f} "
            f"{statistics.median(itl) * 1e3:>7.1f} {statistics.median(ratio):>15.2f} "
            f"[{min(ratio):.2f}, {max(ratio):.2f}]"
        )
    return 0


@contextlib.contextmanager
def cluster(tree: Path, model: str, serve_args: list[str]):
    """A 1P1D cluster of `tree`'s code sending every prompt through its prefill worker."""
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-handoff-"))
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--prefill", "1", "--decode", "1"]
    command += ["--port", str(port), "--log-dir", str(log_dir), "--kv-cache-gib", "0.5"]
    command += ["--served-model-name", model, "--route-policy", "length"]
    command += ["--disaggregate-min-tokens", "0", *serve_args]
    # In the tree: `python -m` puts the working directory first on the path, before PYTHONPATH.
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    print(f"starting {tree} (logs: {log_dir})", file=sys.stderr)
    what = f"pdserve serve ({tree})"
    with served(command, log_dir / "serve.log", port, what, 600, env, cwd=tree) as url:
        yield url


async def measure(urls: list[str], text: PromptText, args) -> dict[str, list[list[float]]]:
    """Each router's requests' gaps between streamed tokens (seconds), round by round."""
    targets = {url: Target(url, args.model, ignore_eos=True) for url in urls}
    for target in targets.values():
        warm = [BenchRequest(args.prompt_tokens, 4, prompt=text.make(args.prompt_tokens))]
        await warm_up(warm, target, 1, args.timeout)
    gaps: dict[str, list[list[float]]] = {url: [] for url in urls}
    for number in range(args.requests):
        for url in urls if number % 2 == 0 else urls[::-1]:
            request = BenchRequest(
                args.prompt_tokens, args.output_len, prompt=text.make(args.prompt_tokens)
            )
            (record,), _ = await run_benchmark(
                [request], targets[url], concurrency=1, timeout=args.timeout, progress=False
            )
            if not record.ok or len(record.itl) < 2:
                raise SystemExit(f"{url}: a request failed or gave under 3 tokens: {record}")
            gaps[url].append(record.itl)
            print(
                f"{url} {number + 1}/{args.requests}: 1st->2nd {record.itl[0] * 1e3:.1f} ms, "
                f"ITL {statistics.median(record.itl[1:]) * 1e3:.1f} ms",
                file=sys.stderr,
            )
    return gaps


if __name__ == "__main__":
    sys.exit(main())
