"""Scale a Mooncake-format trace (github.com/kvcache-ai/Mooncake, FAST'25 traces) down to a
small host, keeping its prefix sharing: a window of it, every Kth conversation, lengths and
block size divided by D, time divided by T.

    python scripts/scale_mooncake_trace.py conversation_trace.jsonl small.jsonl \
        [--window-s 1800] [--every 40] [--length-divisor 32] [--time-divisor 6]

- A conversation is the requests that share their first two blocks (hash ids): a later turn
  resends the earlier turns' blocks and adds its own. (The trace's first block, id 0, is one
  system prompt every request shares.) Every Kth conversation, by its first request's order, is
  kept whole, so the sharing within a conversation is intact and the mix of one-turn and
  many-turn conversations is the trace's.
- A block of 512 tokens becomes one of 512 / D, and each length is divided by D (rounded up,
  at least 1), so a prompt keeps its number of blocks: replay it with `pdserve bench --workload
  trace --trace-format mooncake --trace-block-size 512/D`.
- Timestamps (ms) count from the window's start, divided by T.
Prints what it kept: requests, conversations, the rate, and the infinite-cache block hit rate.
"""

import argparse
import json
import math
import sys
from pathlib import Path

MOONCAKE_BLOCK_SIZE = 512


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a Mooncake-format trace (JSON lines)")
    parser.add_argument("output", type=Path, help="where the scaled trace goes")
    parser.add_argument("--window-s", type=float, default=1800, help="seconds kept (default 1800)")
    parser.add_argument("--every", type=int, default=40, help="keep every Kth conversation (40)")
    parser.add_argument(
        "--length-divisor", type=int, default=32, help="divides lengths and the block (32)"
    )
    parser.add_argument("--time-divisor", type=float, default=6, help="divides time (default 6)")
    args = parser.parse_args()
    if MOONCAKE_BLOCK_SIZE % args.length_divisor or min(args.every, args.time_divisor) <= 0:
        parser.error("--length-divisor must divide 512; --every and --time-divisor positive")
    rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    kept = scale(rows, args.window_s, args.every, args.length_divisor, args.time_divisor)
    args.output.write_text("".join(json.dumps(row) + "\n" for row in kept))
    conversations = len({conversation_key(row) for row in kept})
    span_s = (kept[-1]["timestamp"] - kept[0]["timestamp"]) / 1e3 if len(kept) > 1 else 0.0
    print(
        f"kept {len(kept)} requests of {conversations} conversations over {span_s:.0f} s "
        f"({len(kept) / span_s if span_s else 0:.2f} req/s), block size "
        f"{MOONCAKE_BLOCK_SIZE // args.length_divisor}; infinite-cache block hit rate "
        f"{block_hit_rate(kept):.1%}; wrote {args.output}"
    )
    return 0


def conversation_key(row: dict) -> tuple:
    return tuple(row["hash_ids"][:2])


def scale(
    rows: list[dict], window_s: float, every: int, length_divisor: int, time_divisor: float
) -> list[dict]:
    start = rows[0]["timestamp"]
    window = [row for row in rows if row["timestamp"] - start <= window_s * 1e3]
    order: dict[tuple, int] = {}
    for row in window:
        order.setdefault(conversation_key(row), len(order))
    kept = []
    for row in window:
        if order[conversation_key(row)] % every:
            continue
        kept.append(
            {
                "timestamp": round((row["timestamp"] - start) / time_divisor),
                "input_length": max(1, math.ceil(row["input_length"] / length_divisor)),
                "output_length": max(1, math.ceil(row["output_length"] / length_divisor)),
                "hash_ids": row["hash_ids"],
            }
        )
    return kept


def block_hit_rate(rows: list[dict]) -> float:
    """The share of blocks an earlier request already had as its leading blocks' prefix."""
    seen, hits, total = set(), 0, 0
    for row in rows:
        ids = row["hash_ids"]
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        hits, total = hits + leading, total + len(ids)
        seen.update(ids)
    return hits / total if total else 0.0


if __name__ == "__main__":
    sys.exit(main())
