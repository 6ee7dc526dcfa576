"""A client that leaves before its first token (security review M6): a request waiting in the
admission queue leaves it and never reaches a worker; one whose run is starting is aborted on
its worker; either way its turn goes back (`gate.running` returns to 0) at once, not when the
garbage collector finds it. The assembled app is called as ASGI with a client that sends its
body, then disconnects when told; the fake worker never sends a first chunk until released."""

import asyncio

import pytest

from pdserve.protocol import worker_pb2
from tests.fakes import FakeHttpClient, FakeWorker, app_with_workers

WAIT_S = 5.0


class StalledWorker(FakeWorker):
    """Sends nothing until `go` is set (then one token per choice); records the requests it
    got and those it saw end without finishing (aborted)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.identity.max_num_seqs = 64
        self.go = asyncio.Event()
        self.aborted: list[str] = []

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float):
        self.requests.append(request)
        finished = False
        try:
            await self.go.wait()
            for index in range(max(request.sampling.n, 1)):
                yield worker_pb2.GenerateChunk(index=index, token_ids=[104], text="h")
                await asyncio.sleep(3600)  # the stream's rest never comes
            finished = True
        finally:
            if not finished:
                self.aborted.append(request.request_id)


async def until(condition, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.fixture
def served(monkeypatch):
    worker = StalledWorker("decode-a")
    app = app_with_workers(monkeypatch, worker, max_concurrent_requests=1)
    return app, worker


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_first_token_frees_its_place_and_aborts_its_run(served, stream):
    app, worker = served
    gate = app.state.gate
    body = {"prompt": "hi", "max_tokens": 2, "stream": stream}

    async def go():
        first = FakeHttpClient(app, "/v1/completions", body)
        await until(lambda: len(worker.requests) == 1, "the first request at the worker")
        second = FakeHttpClient(
            app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
        )
        await until(lambda: len(gate.waiting) == 1, "the second request queued")
        second.leave()  # while queued
        await asyncio.wait_for(second.task, WAIT_S)
        assert gate.waiting == [] and len(worker.requests) == 1  # it never reached the worker
        first.leave()  # while its run starts (no first chunk yet)
        await asyncio.wait_for(first.task, WAIT_S)
        assert worker.aborted == [worker.requests[0].request_id]
        assert gate.running == 0
        return first.status(), second.status()

    assert asyncio.run(go()) == (499, 499)
    metrics = app.state.metrics.registry
    assert (
        metrics.get_sample_value(
            "pdserve_requests_total", {"endpoint": "completions", "status": "499"}
        )
        == 1
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_after_its_first_token_frees_its_place_at_once_and_aborts_its_run(
    served, stream
):
    """A stream has answered 200 by then (it ends between two events), a whole response answers
    499; either is counted once as a 499 (a client disconnect)."""
    app, worker = served
    gate = app.state.gate
    registry = app.state.metrics.registry

    async def go():
        worker.go.set()  # one chunk, then the stream stalls: a response never whole
        body = {"prompt": "hi", "max_tokens": 5, "stream": stream}
        client = FakeHttpClient(app, "/v1/completions", body)
        first_tokens = "pdserve_time_to_first_token_seconds_count"
        await until(lambda: registry.get_sample_value(first_tokens) == 1, "its first token")
        assert gate.running == 1
        client.leave()
        await asyncio.wait_for(client.task, WAIT_S)
        assert gate.running == 0
        assert worker.aborted == [worker.requests[0].request_id]
        return client.status()

    assert asyncio.run(go()) == (200 if stream else 499)
    labels = {"endpoint": "completions", "status": "499"}
    assert registry.get_sample_value("pdserve_requests_total", labels) == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_gone_while_sending_its_body_is_no_500(served, path, caplog):
    app, worker = served

    async def go():
        client = FakeHttpClient(app, path, {})
        client.messages = [{"type": "http.request", "body": b'{"prompt": "h', "more_body": True}]
        client.leave()
        await asyncio.wait_for(client.task, WAIT_S)
        return client.status()

    assert asyncio.run(go()) == 499
    assert worker.requests == []
    assert "unexpected error" not in caplog.text
