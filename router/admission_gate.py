"""Admission control: at most `capacity` requests run at once, at most `max_queued` wait for a
turn, each for at most `queue_timeout_s`; beyond that a 429 with Retry-After, never an
unbounded wait and never a 5xx for load.

The capacity is what the workers say they can run at once (the sum of their engines'
`max_num_seqs`, from Health), unless `--max-concurrent-requests` sets it: below it nobody is
refused, so a user never sees a 429 below the cluster's real capacity. A request holds its
turn from admission to its last token; turns go to waiters in arrival order.
"""

import asyncio
import collections
import time
from collections.abc import Callable

from router.errors import OpenAIError, too_many_requests

RETRY_AFTER_S = 1


class AdmissionGate:
    def __init__(
        self,
        capacity: Callable[[], int],
        max_queued: Callable[[], int],
        queue_timeout_s: float,
        metrics,
    ) -> None:
        self.capacity = capacity
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.running = 0
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    async def enter(self) -> "Turn":
        """Take a turn, waiting for one if all are taken; a 429 when the queue is full or the
        wait passes its deadline. With no capacity known (no worker up) the request goes on,
        to be answered 503 by the flow."""
        capacity = self.capacity()
        if capacity <= 0 or (self.running < capacity and not self.waiting):
            self._admit()
            return Turn(self)
        if len(self.waiting) >= self.max_queued():
            raise self._reject("the router's queue is full")
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        self.metrics.queue_length.set(len(self.waiting))
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.queue_timeout_s)
        except TimeoutError:
            if not turn.done():  # (a turn handed over as the wait ran out is taken after all)
                self._forget(turn)
                raise self._reject(
                    f"no turn came within {self.queue_timeout_s:g} s in the router's queue"
                ) from None
        except asyncio.CancelledError:  # the client left while it waited
            if turn.done():
                self.leave()
            else:
                self._forget(turn)
            raise
        self.metrics.queue_wait.observe(time.monotonic() - started)
        return Turn(self)

    def _forget(self, turn: asyncio.Future) -> None:
        self.waiting.remove(turn)
        self.metrics.queue_length.set(len(self.waiting))

    def leave(self) -> None:
        """A request ended (any way): its turn goes to the first waiter, or back to the pool."""
        self.running -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        while self.waiting and self.running < self.capacity():
            turn = self.waiting.popleft()
            self._admit()
            turn.set_result(True)
        self.metrics.queue_length.set(len(self.waiting))

    def _admit(self) -> None:
        self.running += 1
        self.metrics.admitted.inc()

    def _reject(self, why: str) -> OpenAIError:
        self.metrics.rejected.inc()
        return too_many_requests(
            f"{why} ({self.running} requests running, capacity {self.capacity()}); "
            f"retry in {RETRY_AFTER_S} s"
        )


class Turn:
    """A request's turn, given back exactly once: when it ends, or, should the response never
    start (its stream dropped unread), when the turn is garbage."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.gate.leave()

    def __del__(self) -> None:
        self.give_back()
