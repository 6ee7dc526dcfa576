"""Whether vLLM's own offline engine gives the same greedy tokens at tensor parallelism 1 and 2
on a model: where it does not, no P/D answer across those TP sizes can equal "vLLM's answer",
and pdserve's tests check such pairings by what moved instead (tests/integration/test_mla.py).

    python scripts/vllm_tp_agreement.py tiny            # the tiny Llama: agrees
    python scripts/vllm_tp_agreement.py tiny-mla --dtype bfloat16

Each TP size runs in its own process (vLLM's CPU platform spawns its workers), with a 256 MiB KV
cache and four short prompts, 12 tokens each.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "1 2 3 4",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
]
MAX_TOKENS = 12
RUN_TIMEOUT_S = 600


def run_engine(folder: str, dtype: str, tp: int, out: Path) -> None:
    """In a child process: vLLM's offline LLM at `tp`, its greedy tokens written to `out`."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=folder,
        dtype=dtype,
        tensor_parallel_size=tp,
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
    )
    answers = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    out.write_text(json.dumps([list(answer.outputs[0].token_ids) for answer in answers]))


def tokens_at(folder: str, dtype: str, tp: int, work: Path) -> list[list[int]]:
    out = work / f"tp{tp}.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in range(tp))}
    done = subprocess.run(
        [sys.executable, __file__, "--engine", folder, dtype, str(tp), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if done.returncode != 0:
        sys.exit(f"vLLM at TP {tp} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    if sys.argv[1:2] == ["--engine"]:
        folder, dtype, tp, out = sys.argv[2:6]
        run_engine(folder, dtype, int(tp), Path(out))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder, or a name `pdserve model path` knows")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (default float32)")
    args = parser.parse_args()
    from pdserve.model_store.store import resolve_model

    folder = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as work:
        runs = {tp: tokens_at(folder, args.dtype, tp, Path(work)) for tp in (1, 2)}
    same = 0
    for prompt, one, two in zip(PROMPTS, runs[1], runs[2], strict=True):
        pairs = enumerate(zip(one, two, strict=False))  # an answer may end early (EOS)
        first = next((i for i, (a, b) in pairs if a != b), min(len(one), len(two)))
        same += one == two
        where = "same tokens" if one == two else f"differ from token {first}"
        print(f"{prompt!r}: TP 1 and TP 2 {where}")
    print(f"{args.model} ({args.dtype}): {same} of {len(PROMPTS)} prompts agree at TP 1 and TP 2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
