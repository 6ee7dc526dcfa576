"""pdserve/core/fan_out.py with fake streams standing in for engine requests: the first choice
runs
alone until its first output, errors end every stream, and closing early cancels them all."""

import asyncio
import contextlib

import pytest

from pdserve.core.fan_out import fan_out


class FakeEngineRequest:
    """An engine request's outputs: `items`, one per loop turn; records when it started and
    whether it was cancelled (what aborts a real engine request)."""

    def __init__(self, events: list, name: str, items=("a", "b"), error=None, wait=False):
        self.events, self.name, self.items, self.error, self.wait = events, name, items, error, wait

    async def __call__(self):
        self.events.append(f"{self.name} started")
        try:
            for item in self.items:
                await asyncio.sleep(0)
                yield f"{self.name}{item}"
            if self.error is not None:
                raise self.error
            if self.wait:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.events.append(f"{self.name} cancelled")
            raise


def collect(streams) -> list:
    async def go():
        return [item async for item in fan_out(streams)]

    return asyncio.run(asyncio.wait_for(go(), 10))


def test_the_other_choices_start_at_the_first_ones_first_output():
    events: list = []
    streams = [FakeEngineRequest(events, f"c{i}") for i in range(3)]
    items = collect(streams)
    assert events[0] == "c0 started" and events.count("c1 started") == 1
    assert sorted(items) == sorted((i, f"c{i}{x}") for i in range(3) for x in "ab")
    assert items[0] == (0, "c0a")
    assert [item for choice, item in items if choice == 2] == ["c2a", "c2b"]  # in order


def test_one_choice_is_one_stream():
    events: list = []
    assert collect([FakeEngineRequest(events, "c0")]) == [(0, "c0a"), (0, "c0b")]


def test_an_error_in_one_choice_cancels_the_others_and_is_raised():
    events: list = []
    streams = [
        FakeEngineRequest(events, "c0", wait=True),
        FakeEngineRequest(events, "c1", error=ValueError("refused")),
    ]
    with pytest.raises(ValueError, match="refused"):
        collect(streams)
    assert "c0 cancelled" in events


def test_closing_the_merged_stream_cancels_every_choice():
    events: list = []
    streams = [FakeEngineRequest(events, f"c{i}", wait=True) for i in range(2)]

    async def go():
        async with contextlib.aclosing(fan_out(streams)) as merged:
            async for _ in merged:
                break

    asyncio.run(asyncio.wait_for(go(), 10))
    assert events.count("c0 cancelled") == 1
