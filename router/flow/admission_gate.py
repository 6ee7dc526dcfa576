"""Admission control: at most `capacity` sequences run at once, at most `max_queued` requests
wait for a turn, each for at most `queue_timeout_s`; beyond that a 429 with Retry-After, never an
unbounded wait and never a 5xx for load.

The capacity is what the workers say they can run at once (the sum of their engines'
`max_num_seqs`, from Health), unless `--max-concurrent-requests` sets it: below it nobody is
refused, so a user never sees a 429 below the cluster's real capacity. Capacity counts engine
sequences, as max_num_seqs does: a request's turn weighs what it runs at once (its prompts × its
choices, router/flow/admission.py's `sequences`), so one request of 64 prompts × n=128 is not one
slot. A turn heavier than the whole capacity waits until nothing else runs. A request holds its
turn from admission to its last token.

With no capacity (no decode worker live: an outage, a restart) requests go on, to wait for a
worker (--worker-wait) or be answered 503 by the flow, but only up to `max_queued` of them, or
the last capacity the workers had: past that a 503 at once, so that an outage never piles up
requests (and their bodies) in the router.

Turns go to waiters by class, then in arrival order: a request's priority (smaller first, 0 by
default) puts it ahead of every waiter of a larger one, a full queue drops its last waiter for
a newcomer of a smaller class, and a waiter pushed back past its limit is refused then. A
request with a limit (`--max-queue-wait`, or its own deadline) is refused at once when the
forecast says its prompt would start computing after it: the turns ahead of it, at the time a
turn is held (router/flow/wait_forecast.py's price, scaled by what the turns given back took
against theirs), plus the prompts queued on the workers (router/flow/wait_forecast.py).
Retry-After says when the queue ahead will have drained enough.
"""

import asyncio
import bisect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.flow.wait_forecast import Ask, WaitForecast
from router.http.errors import OpenAIError, too_many_requests, worker_unavailable

HOLD_LEARNING_RATE = 0.2  # weight of the last turn given back in the learned hold ratio
OUTAGE_WAITERS = 64  # sequences that may wait out an outage when no bound or capacity is known


@dataclass(order=True)
class Waiter:
    key: tuple[int, int]  # (priority, arrival number): the order turns are given in
    ask: Ask = field(compare=False)
    turn: asyncio.Future = field(compare=False)
    weight: int = field(default=1, compare=False)  # the sequences its turn holds


class AdmissionGate:
    def __init__(
        self,
        capacity: Callable[[], int],
        max_queued: Callable[[], int],
        queue_timeout_s: float,
        metrics,
        forecast: WaitForecast,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = capacity
        self.clock = clock  # monotonic seconds: limits, waits and the time turns are held
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.metrics = metrics
        self.forecast = forecast
        self.running = 0  # sequences the turns given hold
        self.last_capacity = 0  # the last capacity above 0: what an outage's waiters are bound by
        self.waiting: list[Waiter] = []  # sorted: the next turn goes to the first
        self.unstarted_tokens = 0  # prompt tokens of the turns given, no first token yet
        self.hold_ratio: float | None = None  # turns' held time over their price, learned
        self._arrivals = itertools.count()

    async def enter(self, ask: Ask, weight: int = 1) -> "Turn":
        """Take a turn of `weight` sequences, waiting for one if they are taken; a 429 when the
        queue is full, when the forecast says the turn would come too late, or when the wait
        passes its deadline. With no capacity known (no worker up) the request goes on, to be
        answered by the flow, unless an outage's bound is reached (a 503 at once)."""
        capacity = self.capacity()
        if capacity <= 0:
            return self._admit_in_outage(ask, max(1, weight))
        self.last_capacity = capacity
        weight = max(1, weight)
        waiter = Waiter((ask.priority, next(self._arrivals)), ask, None, weight)
        ahead = bisect.bisect(self.waiting, waiter)
        if late := self._too_late(ask, ahead):
            raise late
        if ahead == 0 and self._fits(weight, capacity):
            return self._admit(ask, weight)
        if len(self.waiting) >= self.max_queued():
            if not self.waiting or self.waiting[-1].key[0] <= ask.priority:
                raise self._reject("the router's queue is full", self._turn_s(ask))
            self._refuse(self.waiting.pop(), "a request of a smaller priority took its place")
        waiter.turn = asyncio.get_running_loop().create_future()
        self.waiting.insert(ahead, waiter)
        self._shed_pushed_back(ahead + 1)
        self.metrics.queue_length.set(len(self.waiting))
        started = self.clock()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.turn), self.queue_timeout_s)
        except TimeoutError:
            # (a turn handed over as the wait ran out is taken after all)
            if not waiter.turn.done():
                self._forget(waiter)
                raise self._reject(
                    f"no turn came within {self.queue_timeout_s:g} s in the router's queue",
                    self._turn_s(ask),
                ) from None
        except asyncio.CancelledError:  # the client left while it waited
            if waiter.turn.done() and not waiter.turn.exception():
                waiter.turn.result().give_back()
            elif not waiter.turn.done():
                self._forget(waiter)
            raise
        self.metrics.queue_wait.observe(self.clock() - started)
        return waiter.turn.result()

    def _fits(self, weight: int, capacity: int) -> bool:
        """A turn of `weight` sequences can start now: it fits beside the running ones, or,
        heavier than the whole capacity, nothing runs."""
        return self.running + min(weight, capacity) <= capacity

    def _admit_in_outage(self, ask: Ask, weight: int) -> "Turn":
        """No capacity: the request goes on to wait for a worker, unless as many sequences as
        `max_queued` (else the last capacity known) already do: then a 503 at once."""
        bound = self.max_queued() or self.last_capacity or OUTAGE_WAITERS
        if self.running and self.running + weight > bound:
            raise worker_unavailable(
                f"no decode or colocated worker is live, and {self.running} sequences already "
                f"wait for one (at most {bound}); retry later"
            )
        return self._admit(ask, weight)

    def _wait_parts(self, ask: Ask, ahead: int) -> tuple[float, float]:
        """The forecast of when a request with `ahead` waiters before it starts computing its
        prompt, in its two parts: seconds until its turn, then of prompts queued on the
        workers."""
        turns = ahead + 1 + self.running - self.capacity()  # to come back before its own
        queue_s = max(0, turns) * self._turn_s(ask)
        return queue_s, self.forecast.backlog_s(self.unstarted_tokens)

    def _turn_s(self, ask: Ask) -> float:
        """Seconds between two turns coming back, all of them taken."""
        capacity = max(1, self.capacity())
        ratio = 1.0 if self.hold_ratio is None else self.hold_ratio
        return ratio * self.forecast.hold_s(ask, capacity) / capacity

    def _too_late(self, ask: Ask, ahead: int) -> OpenAIError | None:
        """The 429 for a request whose prompt would start past its limit; None when in time."""
        if ask.give_up_at == math.inf:
            return None
        queue_s, backlog_s = self._wait_parts(ask, ahead)
        wait_s = queue_s + backlog_s
        late_s = self.clock() + wait_s - ask.give_up_at
        if late_s <= 0:
            return None
        return self._reject(
            f"its prompt would start in {wait_s:.1f} s ({queue_s:.1f} s for a turn, "
            f"{backlog_s:.1f} s behind the prompts queued on the workers), past its limit "
            f"(--max-queue-wait or its deadline; {ahead} waiting ahead of it)",
            late_s,
        )

    def _shed_pushed_back(self, first: int) -> None:
        """Refuse the waiters from `first` on that a newcomer put past their limit."""
        kept = self.waiting[:first]
        for waiter in self.waiting[first:]:
            if late := self._too_late(waiter.ask, len(kept)):
                waiter.turn.set_exception(late)
            else:
                kept.append(waiter)
        self.waiting = kept

    def _refuse(self, waiter: Waiter, why: str) -> None:
        waiter.turn.set_exception(self._reject(why, self._turn_s(waiter.ask)))

    def _forget(self, waiter: Waiter) -> None:
        self.waiting.remove(waiter)
        self.metrics.queue_length.set(len(self.waiting))

    def leave(self, turn: "Turn") -> None:
        """A request ended (any way): its turn goes to the first waiters it makes room for (in
        order: a heavy one at the head is not overtaken), or back to the pool."""
        self.running -= turn.weight
        self.started(turn)
        self._learn_hold(turn)
        capacity = self.capacity()
        while self.waiting and capacity > 0 and self._fits(self.waiting[0].weight, capacity):
            waiter = self.waiting.pop(0)
            waiter.turn.set_result(self._admit(waiter.ask, waiter.weight))
        self.metrics.queue_length.set(len(self.waiting))

    def _learn_hold(self, turn: "Turn") -> None:
        """What the turn took against its price, priced now: on the costs the forecast knows
        when the ratio is used. A price taken at admission was often on the default costs (no
        worker had reported its own yet), and the ratio learned against it then scaled the
        learned costs, 1.6 times too slow on this machine: bursts refused that fit."""
        priced_s = self.forecast.hold_s(turn.ask, max(1, self.capacity()))
        if priced_s > 0:
            ratio = (self.clock() - turn.given_at) / priced_s
            learned = ratio if self.hold_ratio is None else self.hold_ratio
            self.hold_ratio = learned + HOLD_LEARNING_RATE * (ratio - learned)

    def started(self, turn: "Turn") -> None:
        if not turn.started:
            turn.started = True
            self.unstarted_tokens -= turn.ask.prompt_tokens

    def _admit(self, ask: Ask, weight: int = 1) -> "Turn":
        self.running += weight
        self.unstarted_tokens += ask.prompt_tokens
        self.metrics.admitted.inc()
        return Turn(self, ask, weight)

    def _reject(self, why: str, retry_after_s: float) -> OpenAIError:
        self.metrics.rejected.inc()
        retry_after = max(1, math.ceil(retry_after_s))
        return too_many_requests(
            f"{why} ({self.running} sequences running, capacity {self.capacity()}); "
            f"retry in {retry_after} s",
            retry_after,
        )


class Turn:
    """A request's turn, given back exactly once: when it ends, or, should the response never
    start (its stream dropped unread), when the turn is garbage."""

    def __init__(self, gate: AdmissionGate, ask: Ask, weight: int = 1) -> None:
        self.gate = gate
        self.ask = ask
        self.weight = weight  # the sequences it holds
        self.given_at = gate.clock()
        self.started = False  # its first token came: its prompt no longer waits on a worker
        self.held = True

    def first_token(self) -> None:
        self.gate.started(self)

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.gate.leave(self)

    def __del__(self) -> None:
        self.give_back()
