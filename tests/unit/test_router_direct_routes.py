"""The generation endpoints are called straight from the app (router/http/direct_routes.py),
past FastAPI's stack: what a client gets is what that stack answers, a streamed event is one
call of the server's `send`, an unexpected exception is the app's 500, the API-key guard holds,
and the routes' other methods are FastAPI's 405."""

import asyncio
import re
import sys

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.fakes import FakeHttpClient, app_with_workers

STREAM = {"model": "m", "prompt": "hi", "max_tokens": 4, "n": 3, "stream": True}  # 3 events
WHOLE = {"model": "m", "prompt": "hi", "max_tokens": 4}
REFUSED = {"model": "m", "prompt": "hi", "max_tokens": -1}


def through_fastapi(app):
    """The same app, through FastAPI's own stack and route."""
    return lambda scope, receive, send: FastAPI.__call__(app, scope, receive, send)


def answered(app, body: dict, path: str = "/v1/completions") -> list[dict]:
    """The messages the app sends for one request, its response's id and time left out."""

    async def go():
        client = FakeHttpClient(app, path, body)
        await asyncio.wait_for(client.task, 5.0)
        return client.sent

    messages = []
    for message in asyncio.run(go()):
        message = dict(message)
        if "body" in message:
            message["body"] = re.sub(rb'"(id|created)":\s*[^,]+,', b"", message["body"])
        if "headers" in message:
            message["headers"] = [
                h for h in message["headers"] if h[0] not in (b"x-request-id", b"content-length")
            ]
        messages.append(message)
    return messages


def test_the_client_gets_what_fastapis_stack_answers(monkeypatch):
    for body in (STREAM, WHOLE, REFUSED):
        direct = answered(app_with_workers(monkeypatch), body)
        stacked = answered(through_fastapi(app_with_workers(monkeypatch)), body)
        assert direct == stacked
    streamed = answered(app_with_workers(monkeypatch), STREAM)
    assert streamed[0]["type"] == "http.response.start" and streamed[0]["status"] == 200
    events = b"".join(m["body"] for m in streamed[1:])
    assert events.count(b"data: {") == 3 and events.endswith(b"data: [DONE]\n\n")
    assert answered(app_with_workers(monkeypatch), REFUSED)[0]["status"] == 400


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
        client = RecordingClient(app, "/v1/completions", STREAM)
        await asyncio.wait_for(client.task, 5.0)
        return client.callers

    return asyncio.run(go())


def test_each_event_is_one_call_of_the_servers_send(monkeypatch):
    direct = callers(app_with_workers(monkeypatch))
    stacked = callers(through_fastapi(app_with_workers(monkeypatch)))
    assert {caller for _, caller in direct} == {"_send_events"}  # the response's own
    assert {caller for _, caller in stacked} == {"_send"}  # Starlette's outermost layer
    assert len(direct) == len(stacked) > 3


def test_an_unexpected_exception_is_the_apps_500(monkeypatch, caplog):
    app = app_with_workers(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app.state.gate, "enter", broken)
    reply = TestClient(app, raise_server_exceptions=False).post("/v1/completions", json=WHOLE)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "server_error" and "a bug" not in error["message"]
    assert "a bug" in caplog.text  # the details in the log only


def test_the_api_key_guards_them_and_other_methods_are_405(monkeypatch):
    app = app_with_workers(monkeypatch, api_key=["sk-1"])
    client = TestClient(app)
    assert client.post("/v1/completions", json=WHOLE).status_code == 401
    assert client.post("/v1/chat/completions", json=WHOLE).status_code == 401
    reply = client.post("/v1/completions", json=WHOLE, headers={"Authorization": "Bearer sk-1"})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    got = client.get("/v1/completions", headers={"Authorization": "Bearer sk-1"})
    assert got.status_code == 405
