"""Which worker of a pool takes a request: pluggable policies, chosen with `--policy`.

A policy sees the live candidates and picks one; it never waits. `least-loaded` compares the
router's own count of outstanding tokens per worker (prompt + max_tokens of requests in flight
there), which is exact for what this router sent and needs no round trip.
"""

import itertools

from router.worker_client import WorkerClient


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[WorkerClient]) -> WorkerClient:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoaded:
    name = "least-loaded"

    def choose(self, candidates: list[WorkerClient]) -> WorkerClient:
        return min(candidates, key=lambda worker: worker.outstanding_tokens)


POLICIES = {policy.name: policy for policy in (RoundRobin, LeastLoaded)}
