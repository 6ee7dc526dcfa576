"""Clients that send their body slowly, or never finish it (security review L11): each holds
its bytes no longer than BODY_TIMEOUT_S (a 408), all of them together no more than the app's
BodyBytes limit (a 429 for the one past it, whose bytes are let go at once), and uvicorn
holds at most LIMIT_CONCURRENCY connections and requests."""

import asyncio
import json

from pdserve.settings.router import RouterSettings
from router import command
from router.http import body
from tests.fakes import FakeHttpClient, app_with_workers

WAIT_S = 5.0  # a bound on each wait, never reached when the router does its part


def stalled(app, sent: bytes) -> FakeHttpClient:
    """A client that sends `sent` of a body, then nothing more (it never leaves)."""
    client = FakeHttpClient(app, "/v1/completions", {})
    client.messages = [{"type": "http.request", "body": sent, "more_body": True}]
    return client


def error_of(client: FakeHttpClient) -> dict:
    [response] = [m for m in client.sent if m["type"] == "http.response.body"]
    return json.loads(response["body"])["error"]


def test_a_body_that_never_ends_is_a_408_after_the_deadline(monkeypatch):
    monkeypatch.setattr(body, "BODY_TIMEOUT_S", 0.2)
    app = app_with_workers(monkeypatch)

    async def go():
        client = stalled(app, b'{"prompt": "h')
        await asyncio.wait_for(client.task, WAIT_S)
        return client

    client = asyncio.run(go())
    assert client.status() == 408
    assert error_of(client)["code"] == "timeout"
    assert app.state.bodies.held == 0
    assert app.state.pool.workers[0].requests == []


def test_bodies_being_read_hold_no_more_than_the_limit_in_all(monkeypatch):
    app = app_with_workers(monkeypatch)
    app.state.bodies.limit = 100

    async def go():
        first = stalled(app, b'{"prompt": "' + b"h" * 60)
        await asyncio.sleep(0.05)
        assert app.state.bodies.held == 72
        second = stalled(app, b'{"prompt": "' + b"h" * 60)
        await asyncio.wait_for(second.task, WAIT_S)  # refused at once
        assert app.state.bodies.held == 72
        first.leave()
        await asyncio.wait_for(first.task, WAIT_S)
        return first, second

    first, second = asyncio.run(go())
    assert second.status() == 429
    assert error_of(second)["code"] == "rate_limit_exceeded"
    assert app.state.bodies.held == 0
    assert first.status() == 499


def test_uvicorn_holds_a_bounded_number_of_connections(monkeypatch):
    app = app_with_workers(monkeypatch)
    config = command.server_config(app, RouterSettings(model="m", port=8000))
    assert config.limit_concurrency == command.LIMIT_CONCURRENCY == 8192
    assert config.timeout_keep_alive == command.KEEP_ALIVE_S
    assert (config.host, config.port) == ("127.0.0.1", 8000)
