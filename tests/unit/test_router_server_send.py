"""A streamed response's events go straight to the server's own `send` (router/command.py runs
the app inside ExposeServerSend: Starlette's error layers wrap `send`, a call on every token, only
to note that a response started, which its start message, still sent through them, tells them).
What the client gets is what the app sends without it."""

import asyncio
import re
import sys

from router.http.generation import ExposeServerSend
from tests.fakes import FakeHttpClient, app_with_workers

BODY = {"model": "m", "prompt": "hi", "max_tokens": 4, "n": 3, "stream": True}  # 3 events


def streamed(app) -> list[dict]:
    """The messages a streamed completion sends, its response's id and time left out."""

    async def go():
        client = FakeHttpClient(app, "/v1/completions", BODY)
        await asyncio.wait_for(client.task, 5.0)
        return client.sent

    messages = []
    for message in asyncio.run(go()):
        message = dict(message)
        if "body" in message:
            message["body"] = re.sub(rb'"(id|created)":[^,]+,', b"", message["body"])
        if "headers" in message:
            message["headers"] = [h for h in message["headers"] if h[0] != b"x-request-id"]
        messages.append(message)
    return messages


def test_the_client_gets_what_the_app_sends_without_it(monkeypatch):
    plain = streamed(app_with_workers(monkeypatch))
    exposed = streamed(ExposeServerSend(app_with_workers(monkeypatch)))
    assert exposed == plain
    assert plain[0]["type"] == "http.response.start" and plain[0]["status"] == 200
    events = b"".join(m["body"] for m in plain[1:])
    assert events.count(b"data: {") == 3 and events.endswith(b"data: [DONE]\n\n")
    assert plain[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


class RecordingClient(FakeHttpClient):
    """A client whose `send` (the server's) notes which function called it."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.callers: list[tuple[str, str]] = []  # before the app's task can send
        super().__init__(app, path, body)

    async def send(self, message: dict) -> None:
        self.callers.append((message["type"], sys._getframe(1).f_code.co_name))
        await super().send(message)


def callers(app) -> list[tuple[str, str]]:
    async def go():
        client = RecordingClient(app, "/v1/completions", BODY)
        await asyncio.wait_for(client.task, 5.0)
        return client.callers

    return asyncio.run(go())


def test_the_events_skip_the_apps_layers_and_the_start_does_not(monkeypatch):
    plain = callers(app_with_workers(monkeypatch))
    exposed = callers(ExposeServerSend(app_with_workers(monkeypatch)))
    assert {caller for _, caller in plain} == {"_send"}  # Starlette's outermost layer
    assert exposed[0] == ("http.response.start", "_send")
    assert {caller for _, caller in exposed[1:]} == {"stream_response"}
    assert len(exposed) == len(plain) > 3
