"""router/admission_gate.py, driven with asyncio.run: turns up to the capacity, a FIFO queue up to
its bound, 429s (never an unbounded wait) beyond, and every turn given back exactly once."""

import asyncio
import gc

import pytest

from router.admission_gate import AdmissionGate
from router.errors import OpenAIError
from router.metrics import RouterMetrics
from tests.waiting import until


def gate(capacity: int = 2, queued: int = 2, timeout_s: float = 5.0) -> AdmissionGate:
    return AdmissionGate(lambda: capacity, lambda: queued, timeout_s, RouterMetrics())


def sample(gate: AdmissionGate, name: str) -> float:
    return gate.metrics.registry.get_sample_value(name) or 0.0


def test_below_capacity_a_turn_is_given_at_once():
    g = gate()

    async def go():
        return [await g.enter(), await g.enter()]

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
        first = await g.enter()

        async def waiter(name):
            turn = await g.enter()
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
        held = await g.enter()
        queued = asyncio.create_task(g.enter())
        await until(lambda: len(g.waiting) == 1, 5, "one waiter queued")
        with pytest.raises(OpenAIError) as caught:
            await g.enter()
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
        held = await g.enter()
        with pytest.raises(OpenAIError) as caught:
            await g.enter()
        assert not g.waiting
        held.give_back()
        return caught.value

    error = asyncio.run(go())
    assert error.status == 429 and "within 0.1 s" in error.message
    assert g.running == 0


def test_a_waiter_whose_client_leaves_gives_up_its_place():
    g = gate(capacity=1, queued=5)

    async def go():
        held = await g.enter()
        waiter = asyncio.create_task(g.enter())
        await until(lambda: len(g.waiting) == 1, 5, "the waiter queued")
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not g.waiting
        held.give_back()

    asyncio.run(go())
    assert g.running == 0


def test_with_no_capacity_known_requests_go_on_to_be_answered_by_the_flow():
    g = gate(capacity=0, queued=0)
    turn = asyncio.run(g.enter())
    assert g.running == 1
    turn.give_back()


def test_a_turn_dropped_unused_is_given_back():
    g = gate(capacity=1)
    asyncio.run(g.enter())  # the turn object is dropped at once
    gc.collect()
    assert g.running == 0
