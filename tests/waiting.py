"""Waiting for an observed state, with a deadline: how a test synchronises with the processes it
drives, instead of sleeping a guessed time and hoping the state was reached."""

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """`condition()`'s first truthy value, polled every `poll_s`; fails the test, naming `what`,
    when none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(poll_s)
    return value


async def until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """`wait_for` inside an event loop: polls `condition()` (which must not block) between the
    loop's other tasks."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)
