"""Which worker of a pool takes a request: pluggable policies, chosen with `--policy`.

A policy sees the live candidates and picks one; it never waits. `least-loaded` compares what
the workers themselves report (router/worker_load.py), so that every router ranks them alike.
"""

import itertools

from router.worker_client import WorkerClient


class RoundRobin:
    """Takes turns within each pool: one counter per role, so a disaggregated request's two
    picks (prefill, then decode) do not step one shared counter twice, which sent every
    prefill to the same worker of two."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turns: dict[str, itertools.count] = {}

    def choose(self, candidates: list[WorkerClient]) -> WorkerClient:
        turn = self._turns.setdefault(candidates[0].role, itertools.count())
        return candidates[next(turn) % len(candidates)]


class LeastLoaded:
    """The idlest by its own report: prompt tokens yet to compute (prefill), requests in the
    engine then KV blocks in use (decode); ties go to the first candidate."""

    name = "least-loaded"

    def choose(self, candidates: list[WorkerClient]) -> WorkerClient:
        return min(candidates, key=lambda worker: worker.load.busyness(worker.role))


POLICIES = {policy.name: policy for policy in (RoundRobin, LeastLoaded)}
