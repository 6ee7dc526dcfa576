"""Once the router's server serves, it freezes its startup heap (pdserve/core/heap.py) and says
how to call it, however long its start took: the start waits for the workers to load
(`worker_ready_timeout_s`, minutes for a large model)."""

import asyncio
import time

from pdserve.settings.router import RouterSettings
from router import command

POLLS_TO_START = 1_000  # 100 s of the announcement's 0.1 s polls


class SlowServer:
    """A server whose start takes POLLS_TO_START of the waiter's sleeps."""

    def __init__(self) -> None:
        self.polls = 0

    @property
    def started(self) -> bool:
        return self.polls >= POLLS_TO_START


def test_a_start_that_waits_minutes_for_the_workers_is_still_announced(monkeypatch, capsys):
    server, frozen = SlowServer(), []
    real_sleep, now = asyncio.sleep, [time.monotonic()]

    async def one_poll(seconds: float) -> None:
        server.polls += 1
        assert server.polls <= POLLS_TO_START + 10, "still waiting after the server started"
        now[0] += seconds  # as the host's clock would read
        await real_sleep(0)

    monkeypatch.setattr(command.asyncio, "sleep", one_poll)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(command, "freeze_startup_heap", lambda: frozen.append(server.polls))
    settings = RouterSettings(model="m", worker_addresses=["127.0.0.1:1"])
    asyncio.run(command._announce_when_started(server, settings))  # bounded by one_poll
    assert frozen == [POLLS_TO_START]
    assert "pdserve ready at http://" in capsys.readouterr().err
