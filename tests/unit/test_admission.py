"""router/flow/admission_gate.py, driven with asyncio.run: turns up to the capacity, a FIFO queue up
to its bound, 429s (never an unbounded wait) beyond, and every turn given back exactly once; with
limits and classes, the forecast's refusals at once (tests/unit/test_admission_forecast.py
covers the forecast's figures). A fake forecast with fixed figures."""

import asyncio
import gc

import pytest

from router.flow.admission_gate import AdmissionGate
from router.flow.wait_forecast import Ask
from router.http.errors import OpenAIError
from router.metrics import RouterMetrics
from tests.fakes import FakeClock
from tests.waiting import until

CLOCK = FakeClock()  # the gates' time: it moves only when a test advances it

ANY = Ask()  # no limit, class 0


class FakeForecast:
    """Stands in for router/flow/wait_forecast.py's WaitForecast: a turn held `hold_s`, `backlog_s`
    of prompts queued on the workers; it records the unreported tokens it was asked about."""

    def __init__(self, hold_s: float = 1.0, backlog_s: float = 0.0) -> None:
        self.hold = hold_s
        self.backlog = backlog_s
        self.unreported: list[int] = []

    def hold_s(self, ask: Ask, batch: int) -> float:
        return self.hold

    def backlog_s(self, unreported_tokens: int) -> float:
        self.unreported.append(unreported_tokens)
        return self.backlog


def gate(
    capacity: int = 2, queued: int = 2, timeout_s: float = 5.0, forecast=None
) -> AdmissionGate:
    return AdmissionGate(
        lambda: capacity,
        lambda: queued,
        timeout_s,
        RouterMetrics(),
        forecast or FakeForecast(),
        CLOCK,
    )


def within(seconds: float, priority: int = 0, prompt_tokens: int = 0) -> Ask:
    """A request whose prompt must start within `seconds` from now."""
    return Ask(prompt_tokens, 8, priority, CLOCK() + seconds)


def sample(gate: AdmissionGate, name: str) -> float:
    return gate.metrics.registry.get_sample_value(name) or 0.0


def test_below_capacity_a_turn_is_given_at_once():
    g = gate()

    async def go():
        return [await g.enter(ANY), await g.enter(ANY)]

    turns = asyncio.run(go())
    assert g.running == 2 and sample(g, "pdserve_admitted_total") == 2
    for turn in turns:
        turn.give_back()
        turn.give_back()  # once only
    assert g.running == 0


def test_at_capacity_requests_queue_and_get_turns_in_arrival_order():
    g = gate(capacity=1, queued=3)
    order = []

    async def go():
        first = await g.enter(ANY)

        async def waiter(name):
            turn = await g.enter(ANY)
            order.append(name)
            return turn

        tasks = [asyncio.create_task(waiter(name)) for name in "abc"]
        await until(lambda: len(g.waiting) == 3, 5, "three waiters queued")
        assert order == []
        first.give_back()
        second = await tasks[0]
        second.give_back()
        (await tasks[1]).give_back()
        (await tasks[2]).give_back()

    asyncio.run(go())
    assert order == ["a", "b", "c"] and g.running == 0 and not g.waiting


def test_a_full_queue_is_a_429_at_once():
    g = gate(capacity=1, queued=1)

    async def go():
        held = await g.enter(ANY)
        queued = asyncio.create_task(g.enter(ANY))
        await until(lambda: len(g.waiting) == 1, 5, "one waiter queued")
        with pytest.raises(OpenAIError) as caught:
            await g.enter(ANY)
        held.give_back()
        (await queued).give_back()
        return caught.value

    error = asyncio.run(go())
    assert (error.status, error.code) == (429, "rate_limit_exceeded")
    assert error.type == "rate_limit_error"
    assert "queue is full" in error.message
    assert sample(g, "pdserve_rejected_total") == 1


def test_a_wait_past_the_queue_timeout_is_a_429_and_leaves_the_queue():
    g = gate(capacity=1, queued=5, timeout_s=0.1)

    async def go():
        held = await g.enter(ANY)
        with pytest.raises(OpenAIError) as caught:
            await g.enter(ANY)
        assert not g.waiting
        held.give_back()
        return caught.value

    error = asyncio.run(go())
    assert error.status == 429 and "within 0.1 s" in error.message
    assert g.running == 0


def test_a_waiter_whose_client_leaves_gives_up_its_place():
    g = gate(capacity=1, queued=5)

    async def go():
        held = await g.enter(ANY)
        waiter = asyncio.create_task(g.enter(ANY))
        await until(lambda: len(g.waiting) == 1, 5, "the waiter queued")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not g.waiting
        held.give_back()

    asyncio.run(go())
    assert g.running == 0


def test_with_no_capacity_known_requests_go_on_to_be_answered_by_the_flow():
    g = gate(capacity=0, queued=0)
    turn = asyncio.run(g.enter(ANY))
    assert g.running == 1
    turn.give_back()


def test_a_turn_dropped_unused_is_given_back():
    g = gate(capacity=1)
    asyncio.run(g.enter(ANY))  # the turn object is dropped at once
    gc.collect()
    assert g.running == 0


def test_the_full_queues_429_says_when_the_next_turn_comes_back():
    g = gate(capacity=1, queued=0, forecast=FakeForecast(hold_s=3.2))

    async def go():
        held = await g.enter(ANY)
        with pytest.raises(OpenAIError) as caught:
            await g.enter(ANY)
        held.give_back()
        return caught.value

    error = asyncio.run(go())
    assert error.retry_after_s == 4 and "retry in 4 s" in error.message  # 3.2 s, rounded up


def test_a_request_whose_turn_would_come_past_its_limit_is_refused_at_once():
    g = gate(capacity=2, queued=10, forecast=FakeForecast(hold_s=4.0))

    async def go():
        held = [await g.enter(ANY), await g.enter(ANY)]
        # The first waiter's turn comes after one of two turns back (2 s), the second's after
        # two (4 s), the third's after three (6 s).
        waiters = [asyncio.create_task(g.enter(within(4.5))) for _ in range(2)]
        await until(lambda: len(g.waiting) == 2, 5, "two waiters queued")
        with pytest.raises(OpenAIError) as caught:
            g.enter(within(4.5)).send(None)  # refused at its first step: it never waits
        for turn in held:
            turn.give_back()
        for waiter in waiters:
            (await waiter).give_back()
        return caught.value

    error = asyncio.run(go())
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert "would start in 6.0 s" in error.message
    assert error.retry_after_s == 2  # 6 s against 4.5: the queue drains enough in 1.5 s
    assert g.metrics.registry.get_sample_value("pdserve_rejected_total") == 1
    assert g.running == 0 and not g.waiting


def test_the_workers_backlog_refuses_a_request_even_with_a_turn_free():
    forecast = FakeForecast(backlog_s=9.0)
    g = gate(capacity=4, forecast=forecast)

    async def go():
        turn = await g.enter(within(10, prompt_tokens=300))
        assert g.unstarted_tokens == 300
        with pytest.raises(OpenAIError) as caught:
            await g.enter(within(2.5))
        turn.first_token()  # its prompt computed: no longer counted as waiting on a worker
        assert g.unstarted_tokens == 0
        turn.give_back()
        return caught.value

    error = asyncio.run(go())
    assert error.retry_after_s == 7 and "0 waiting ahead" in error.message
    assert forecast.unreported == [0, 300]  # what the gate had let through, not started
    assert g.running == 0 and g.unstarted_tokens == 0


def test_without_a_limit_the_forecast_refuses_nobody():
    g = gate(capacity=1, queued=5, forecast=FakeForecast(hold_s=1000.0, backlog_s=1000.0))

    async def go():
        held = await g.enter(ANY)
        waiter = asyncio.create_task(g.enter(ANY))
        await until(lambda: len(g.waiting) == 1, 5, "the waiter queued")
        held.give_back()
        (await waiter).give_back()

    asyncio.run(go())
    assert (g.metrics.registry.get_sample_value("pdserve_rejected_total") or 0) == 0


def test_the_time_a_turn_is_held_is_learned_from_the_turns_given_back():
    g = gate(capacity=1, queued=5, forecast=FakeForecast(hold_s=100.0))

    async def go():
        turn = await g.enter(ANY)
        CLOCK.advance(0.2)
        turn.give_back()
        assert g.hold_ratio == pytest.approx(0.002)  # the turn took 0.2 s of 100 s priced
        held = await g.enter(ANY)
        waiter = asyncio.create_task(g.enter(within(5)))  # 100 s priced, held 0.2 s
        await until(lambda: len(g.waiting) == 1, 5, "the waiter queued")
        held.give_back()
        (await waiter).give_back()  # not refused: its turn came at the learned pace

    asyncio.run(go())
    assert g.hold_ratio < 0.002  # the two turns given back since took no time


def test_a_turn_is_priced_when_given_back_on_the_costs_known_then():
    """The first turn is often admitted on the default costs, before any worker reported its
    own: the ratio is learned against the price of the costs it will scale, not those."""
    forecast = FakeForecast(hold_s=1.0)  # the default costs' price
    g = gate(capacity=1, queued=5, forecast=forecast)

    async def go():
        turn = await g.enter(ANY)
        forecast.hold = 2.0  # a worker reported its costs while the turn ran
        CLOCK.advance(2.0)
        turn.give_back()
        assert g.hold_ratio == pytest.approx(1.0)  # not 2.0: the learned costs were right
        held = await g.enter(ANY)
        # One turn ahead, held 2 s: a request that must start within 2.5 s fits.
        waiter = asyncio.create_task(g.enter(within(2.5)))
        await until(lambda: len(g.waiting) == 1, 5, "the waiter queued")
        held.give_back()
        (await waiter).give_back()

    asyncio.run(go())
    assert sample(g, "pdserve_rejected_total") == 0


def test_smaller_priorities_get_turns_first_then_arrival_order():
    g = gate(capacity=1, queued=5)
    order = []

    async def go():
        first = await g.enter(ANY)

        async def waiter(name, priority):
            turn = await g.enter(Ask(priority=priority))
            order.append(name)
            turn.give_back()

        tasks = []
        for name, priority in (("late-1", 1), ("late-2", 1), ("urgent", -1), ("normal", 0)):
            tasks.append(asyncio.create_task(waiter(name, priority)))
            await until(lambda: len(g.waiting) == len(tasks), 5, f"{name} queued")
        first.give_back()
        await asyncio.gather(*tasks)

    asyncio.run(go())
    assert order == ["urgent", "normal", "late-1", "late-2"]


def test_a_full_queue_drops_its_last_waiter_of_a_larger_priority_for_a_smaller_one():
    g = gate(capacity=1, queued=2)

    async def go():
        held = await g.enter(ANY)
        low = [asyncio.create_task(g.enter(Ask(priority=5))) for _ in range(2)]
        await until(lambda: len(g.waiting) == 2, 5, "two low-priority waiters")
        high = asyncio.create_task(g.enter(Ask(priority=0)))
        dropped = await asyncio.gather(low[1], return_exceptions=True)
        with pytest.raises(OpenAIError) as same_class:  # a full queue of its class and better
            await g.enter(Ask(priority=5))
        held.give_back()
        (await high).give_back()
        (await low[0]).give_back()
        return dropped[0], same_class.value

    dropped, same_class = asyncio.run(go())
    assert isinstance(dropped, OpenAIError) and dropped.status == 429
    assert "smaller priority took its place" in dropped.message
    assert "queue is full" in same_class.message
    assert g.running == 0 and not g.waiting


def test_a_waiter_pushed_past_its_limit_by_a_smaller_priority_is_refused_then():
    g = gate(capacity=1, queued=5, forecast=FakeForecast(hold_s=2.0))

    async def go():
        held = await g.enter(ANY)
        low = asyncio.create_task(g.enter(within(3, priority=1)))  # its turn in 2 s: fits
        await until(lambda: len(g.waiting) == 1, 5, "the low-priority waiter")
        high = asyncio.create_task(g.enter(within(3, priority=0)))  # goes first: low's is 4 s
        pushed = await asyncio.gather(low, return_exceptions=True)
        held.give_back()
        (await high).give_back()
        return pushed[0]

    pushed = asyncio.run(go())
    assert isinstance(pushed, OpenAIError) and pushed.status == 429
    assert "would start in 4.0 s" in pushed.message and "1 waiting ahead" in pushed.message
    assert g.running == 0 and not g.waiting


def test_a_turn_weighs_its_sequences_so_an_n_4_request_takes_all_4_slots():
    """Capacity counts engine sequences (max_num_seqs): a request of n=4 (or 4 prompts) holds 4
    of them, and the next request queues behind it (review H4)."""
    g = gate(capacity=4, queued=4)

    async def go():
        heavy = await g.enter(ANY, 4)
        assert g.running == 4
        light = asyncio.create_task(g.enter(ANY))
        await until(lambda: len(g.waiting) == 1, 5, "the next request queued")
        assert not light.done()
        heavy.give_back()
        turn = await light
        assert g.running == 1
        turn.give_back()

    asyncio.run(go())
    assert g.running == 0 and not g.waiting


def test_a_turn_heavier_than_the_capacity_waits_for_an_empty_gate_and_is_not_overtaken():
    g = gate(capacity=4, queued=4)

    async def go():
        small = await g.enter(ANY)
        huge = asyncio.create_task(g.enter(ANY, 10))
        await until(lambda: len(g.waiting) == 1, 5, "the heavy request queued")
        later = asyncio.create_task(g.enter(ANY))  # fits, but the heavy one is ahead
        await until(lambda: len(g.waiting) == 2, 5, "the light request queued behind")
        small.give_back()
        heavy_turn = await huge
        assert g.running == 10 and not later.done()
        heavy_turn.give_back()
        (await later).give_back()

    asyncio.run(go())
    assert g.running == 0 and not g.waiting


def test_in_an_outage_max_queued_requests_go_on_and_the_next_is_a_503_at_once():
    """No capacity (no decode worker live): requests go on to wait for one, but a fifth one
    beyond max_queued 4 is refused at once instead of piling up in the router (review M10)."""
    g = gate(capacity=0, queued=4)

    async def go():
        turns = [await g.enter(ANY) for _ in range(4)]
        with pytest.raises(OpenAIError) as caught:
            g.enter(ANY).send(None)  # refused at its first step: it never waits
        turns.pop().give_back()
        turns.append(await g.enter(ANY))  # room again
        for turn in turns:
            turn.give_back()
        return caught.value

    error = asyncio.run(go())
    assert (error.status, error.code) == (503, "worker_unavailable")
    assert g.running == 0


def test_in_an_outage_with_no_bound_set_the_last_capacity_bounds_the_waiters():
    capacity = [2]
    g = AdmissionGate(lambda: capacity[0], lambda: 0, 5.0, RouterMetrics(), FakeForecast())

    async def go():
        (await g.enter(ANY)).give_back()  # the workers ran 2 at once
        capacity[0] = 0  # then every one of them went away
        turns = [await g.enter(ANY), await g.enter(ANY)]
        with pytest.raises(OpenAIError) as caught:
            await g.enter(ANY)
        for turn in turns:
            turn.give_back()
        return caught.value

    assert asyncio.run(go()).status == 503
    assert g.running == 0
