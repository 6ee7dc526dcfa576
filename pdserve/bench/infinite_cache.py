"""The prefix hit rate an infinite cache would get: the bound a real prefix cache (an engine's,
or a shared KV pool's) is measured against.

An infinite prefix cache holds everything ever computed, so a prompt hits on its longest prefix
that an earlier request already had. A workload that knows its prompts' structure describes each
as a chain of (key, tokens) blocks, equal keys being equal text (a Mooncake trace's hash ids, a
shared prefix); the bound is then exact in the workload's token counts, at token granularity
(a real cache holds whole blocks of its own size, so it can only come close). The conversation
workload computes its own bound as it goes (bench.conversation), its replies being known only
then.
"""

from collections.abc import Hashable

from pdserve.bench.workload import BenchRequest


def mark_cacheable(requests: list[BenchRequest], warmed: int = 0) -> None:
    """Set each request's `cacheable_tokens`, as they go out: the first `warmed` once (the
    warm-up), then all of them in order. Requests without `prefix_blocks` are left unset."""
    if any(r.prefix_blocks is None for r in requests):
        return
    held: dict[Hashable, int] = {}  # key -> the most tokens of that block seen so far

    def send(request: BenchRequest) -> int:
        cached, hitting = 0, True
        for key, tokens in request.prefix_blocks:
            if hitting:  # a prefix cache stops at the first block it lacks
                cached += min(held.get(key, 0), tokens)
                hitting = held.get(key, 0) >= tokens
            held[key] = max(held.get(key, 0), tokens)
        return cached

    for request in requests[:warmed]:
        send(request)
    for request in requests:
        request.cacheable_tokens = send(request)
