"""The router's requests to a worker over one Session (pdserve/worker/session.py and
router/workers/session.py): the router's real WorkerClient and the worker's real session code
over real gRPC on 127.0.0.1; only the engine is a fake (FakeEngineWorker's `run`)."""

import asyncio
import contextlib

import grpc
import pytest

from pdserve.protocol import CREDIT_WINDOW, MAX_MESSAGE_BYTES, worker_pb2, worker_pb2_grpc
from pdserve.worker.session import RequestFailed, ServesSessions
from router.http.errors import OpenAIError
from router.workers.client import WorkerClient
from tests.waiting import until


class FakeEngineWorker(ServesSessions, worker_pb2_grpc.WorkerServicer):
    """A fake engine: a request streams `max_tokens` chunks, each a token of its prompt's first
    id, all requests' together on one step clock (`step`, set each `step_s`); a prompt [0]
    sleeps forever, a prompt [-1] sends one chunk too big for a message. Records what ran."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.step = asyncio.Event()
        self.step_s = step_s
        self.pulled: dict[str, int] = {}  # request id -> chunks its consumer pulled
        self.closed: list[str] = []  # requests whose generator was closed before their end
        self.downs = 0

    async def steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.step.set()
            self.step.clear()

    async def run(self, request, trace_headers):
        request_id, first = request.request_id, request.prompt_token_ids[0]
        self.pulled[request_id] = 0
        finished = False
        try:
            if first == 0:
                await asyncio.sleep(3600)
            if first == -1:
                yield worker_pb2.GenerateChunk(text="x" * MAX_MESSAGE_BYTES)
            for index in range(request.sampling.max_tokens):
                await self.step.wait()
                last = index == request.sampling.max_tokens - 1
                yield worker_pb2.GenerateChunk(
                    token_ids=[first], finish_reason="length" if last else ""
                )
                self.pulled[request_id] += 1
            finished = True
        finally:
            if not finished:
                self.closed.append(request_id)


@contextlib.asynccontextmanager
async def serving(worker: FakeEngineWorker):
    """The router's client of `worker`, served on 127.0.0.1, its engine stepping."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    steps = asyncio.create_task(worker.steps())
    try:
        yield client
    finally:
        steps.cancel()
        await client.close()
        await server.stop(None)


def request(request_id: str, first: int, tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[first, 1],
        sampling=worker_pb2.SamplingParams(max_tokens=tokens),
    )


def test_many_requests_share_one_session_each_getting_its_own_tokens_a_step_in_one_message():
    async def scenario():
        worker = FakeEngineWorker()
        reads = 0
        async with serving(worker) as client:

            async def one(first: int) -> list[int]:
                chunks = [c async for c in client.generate(request(f"r{first}", first, 20), 10)]
                assert chunks[-1].finish_reason == "length"
                return [token for chunk in chunks for token in chunk.token_ids]

            session_read = client.session.call.read

            async def counted_read():
                nonlocal reads
                reads += 1
                return await session_read()

            client.session.call.read = counted_read
            tokens = await asyncio.gather(*(one(first) for first in range(1, 21)))
            assert tokens == [[first] * 20 for first in range(1, 21)]
            return reads

    reads = asyncio.run(scenario())
    # 400 chunks and 20 ends, ~20 steps: far fewer messages than events (one a step when idle)
    assert reads < 200, reads  # a message per event would be 420


def test_a_consumer_that_stops_reading_holds_back_its_own_request_only():
    async def scenario():
        worker = FakeEngineWorker(step_s=0.001)
        async with serving(worker) as client:
            slow = client.generate(request("slow", 7, 3 * CREDIT_WINDOW), 30)
            assert (await anext(slow)).token_ids == [7]  # then it reads no more
            fast = [c async for c in client.generate(request("fast", 8, 2 * CREDIT_WINDOW), 30)]
            assert len(fast) == 2 * CREDIT_WINDOW  # not held by the slow one's backlog
            # (pulled: chunks yielded and asked past; the window's last is yielded, not past)
            await until(lambda: worker.pulled["slow"] >= CREDIT_WINDOW - 1, 10, "the slow one held")
            await asyncio.sleep(0.2)  # many steps: it would have run on, were it not held
            assert worker.pulled["slow"] == CREDIT_WINDOW - 1
            rest = [c async for c in slow]  # reading again, it runs to its end
            assert 1 + len(rest) == 3 * CREDIT_WINDOW and rest[-1].finish_reason == "length"

    asyncio.run(scenario())


def test_a_request_left_early_is_aborted_on_the_worker_and_its_id_can_run_again():
    async def scenario():
        worker = FakeEngineWorker()
        async with serving(worker) as client:
            stream = client.generate(request("r", 5, 1000), 10)
            await anext(stream)
            await stream.aclose()  # the client went away
            await until(lambda: worker.closed == ["r"], 10, "r aborted on the worker")
            again = [c async for c in client.generate(request("r", 6, 3), 10)]
            assert [c.token_ids for c in again] == [[6]] * 3  # none of the first one's

    asyncio.run(scenario())


def test_a_request_past_its_deadline_times_out_and_is_aborted_on_the_worker():
    async def scenario():
        worker = FakeEngineWorker()
        async with serving(worker) as client:
            with pytest.raises(OpenAIError) as caught:
                async for _ in client.generate(request("hangs", 0, 1), timeout=0.3):
                    pass
            await until(lambda: worker.closed == ["hangs"], 10, "hangs aborted on the worker")
            return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.kind) == (504, "timeout"), error.message


def test_a_chunk_too_big_for_a_message_fails_its_request_not_the_session():
    async def scenario():
        worker = FakeEngineWorker()
        async with serving(worker) as client:
            other = asyncio.create_task(
                asyncio.wait_for(
                    _collect(client.generate(request("other", 3, 50), timeout=10)), timeout=20
                )
            )
            with pytest.raises(OpenAIError) as caught:
                async for _ in client.generate(request("big", -1, 1), timeout=10):
                    pass
            assert len(await other) == 50
            return caught.value

    error = asyncio.run(scenario())
    assert error.status == 502 and "RESOURCE_EXHAUSTED" in error.message, error.message


async def _collect(chunks) -> list:
    return [chunk async for chunk in chunks]


def test_a_broken_session_ends_its_requests_as_unavailable_and_the_next_opens_another():
    async def scenario():
        worker = FakeEngineWorker()
        async with serving(worker) as client:
            waiting = [
                asyncio.create_task(_collect(client.generate(request(f"h{i}", 0, 1), 10)))
                for i in range(3)
            ]
            await until(lambda: len(worker.pulled) == 3, 10, "three requests running")
            first = client.session
            first.call.cancel()  # as a broken connection ends it
            for task in waiting:
                with pytest.raises(OpenAIError) as caught:
                    await task
                assert caught.value.kind == "worker_unavailable", caught.value.message
            chunks = await _collect(client.generate(request("after", 4, 2), 10))
            assert len(chunks) == 2 and client.session is not first
            aborted = ["h0", "h1", "h2"]
            await until(lambda: sorted(worker.closed) == aborted, 10, "all three aborted")

    asyncio.run(scenario())


def test_a_request_that_fails_on_the_worker_ends_with_its_status():
    class Refuses(FakeEngineWorker):
        async def run(self, request, trace_headers):
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
            yield

    async def scenario():
        async with serving(Refuses()) as client:
            with pytest.raises(OpenAIError) as caught:
                await _collect(client.generate(request("r", 1, 1), 10))
            return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.message) == (400, "the prompt is empty")


def test_a_stopping_worker_finishes_its_requests_refuses_new_ones_and_ends_the_session():
    """As the worker's stop does (pdserve/worker/command.py's stop_serving): a session is never
    done by itself, so the server's grace would otherwise always run out."""

    async def scenario():
        worker = FakeEngineWorker(step_s=0.02)
        async with serving(worker) as client:
            running = client.generate(request("running", 9, 20), 10)
            first = await anext(running)
            session = client.session  # the one open
            worker.stop_sessions()
            with pytest.raises(OpenAIError) as caught:
                await _collect(client.generate(request("new", 4, 2), 10))
            assert caught.value.kind == "worker_unavailable", caught.value.message
            rest = await _collect(running)
            assert [first, *rest][-1].finish_reason == "length" and len(rest) == 19
            await until(lambda: session.ended is not None, 10, "the session ended")
            assert session.ended.code == grpc.StatusCode.UNAVAILABLE
            assert "ended the session" in session.ended.details

    asyncio.run(scenario())
