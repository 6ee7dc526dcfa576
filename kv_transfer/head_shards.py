"""Which KV heads each tensor-parallel rank holds, and which prefill rank sends which heads to
which decode rank when the two pools run at different tensor-parallel sizes.

vLLM shards the KV heads evenly over the ranks; with fewer KV heads than ranks each head is
replicated on `tp // kv_heads` consecutive ranks (rank r holds head r // replicas). A decode rank
needs the heads it holds; each of them comes from exactly one prefill rank that holds it (with
replicas on the prefill side, spread over them), so nothing is sent twice.
"""

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRoute:
    """Prefill rank `prefill_rank` sends global heads [first_head, first_head + num_heads) to
    decode rank `decode_rank`."""

    prefill_rank: int
    decode_rank: int
    first_head: int
    num_heads: int


def rank_heads(total_heads: int, tp: int, rank: int) -> range:
    """The global KV heads rank `rank` of a TP group holds."""
    if tp <= total_heads:
        per_rank = total_heads // tp
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp // total_heads)
    return range(head, head + 1)


@functools.cache
def head_routes(total_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadRoute, ...]:
    """Every (prefill rank -> decode rank, heads) transfer of one layer, consecutive heads
    merged; together they give each decode rank each of its heads once. Cached: the sender
    asks for every layer of every step."""
    check_shardable(total_heads, prefill_tp)
    check_shardable(total_heads, decode_tp)
    routes: list[HeadRoute] = []
    for decode_rank in range(decode_tp):
        for head in rank_heads(total_heads, decode_tp, decode_rank):
            holders = [
                r for r in range(prefill_tp) if head in rank_heads(total_heads, prefill_tp, r)
            ]
            source = holders[decode_rank % len(holders)]
            last = routes[-1] if routes else None
            if (
                last is not None
                and (last.prefill_rank, last.decode_rank) == (source, decode_rank)
                and last.first_head + last.num_heads == head
            ):
                routes[-1] = HeadRoute(source, decode_rank, last.first_head, last.num_heads + 1)
            else:
                routes.append(HeadRoute(source, decode_rank, head, 1))
    return tuple(routes)


def check_shardable(total_heads: int, tp: int) -> None:
    """As vLLM requires: TP divides the KV heads, or the KV heads divide TP."""
    if tp < 1 or (total_heads % tp if tp <= total_heads else tp % total_heads):
        raise ValueError(f"{total_heads} KV heads cannot be sharded over tensor parallelism {tp}")
