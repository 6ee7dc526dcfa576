"""The worker's side of a router's Session: many requests over one long-lived gRPC stream.

A call per request costs the router and the worker a wake-up (event loop and gRPC's poller) per
token of every request; an engine step makes a token for all its running requests at once, so one
message can carry them all. Each started request runs in its own task (the same code as a
Generate call: `RunRequest`), and its chunks and its end go to one outbox; one writer sends what
the outbox holds whenever the last message has gone (no added wait: under load the outbox fills
while a write is in flight).

Every request ends with an end event (code OK, or the status Generate would fail with), except one
its router aborted. A request runs at most CREDIT_WINDOW chunks ahead of what its router has
taken (the router's credits), so a slow client holds back its own request (vLLM merges its
outputs meanwhile), never the session. When the call ends (the router closed it, or the
connection broke), every request on it is aborted; a stopping worker ends its sessions once their
requests have (`ServesSessions.stop_sessions`).
"""

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.protocol import CREDIT_WINDOW, MAX_MESSAGE_BYTES, worker_pb2

log = logging.getLogger("pdserve.worker")
MESSAGE_BUDGET = MAX_MESSAGE_BYTES // 2  # a message down carries events up to this many bytes
ABORT_WAIT_S = 5.0  # the requests of an ended session get this long to abort in the engine


class RequestFailed(Exception):
    """How a request failed, as a gRPC status: a Generate call fails with it, a session reports
    it in the request's end event."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


# Runs one request: its chunks, or RequestFailed. Takes the request and its caller's trace
# headers (a Generate call's metadata, a session start's trace_headers).
RunRequest = Callable[[worker_pb2.GenerateRequest, dict[str, str]], AsyncIterator]


class ServesSessions:
    """A Worker servicer's Session, for a servicer whose `run` (a RunRequest) runs a request."""

    @functools.cached_property
    def _sessions(self) -> set["WorkerSession"]:
        """Those open now."""
        return set()

    async def Session(self, request_iterator, context):
        session = WorkerSession(self.run)
        self._sessions.add(session)
        try:
            async with contextlib.aclosing(session.serve(request_iterator)) as downs:
                async for down in downs:
                    yield down
        finally:
            self._sessions.discard(session)

    def stop_sessions(self) -> None:
        """The worker is stopping: each session refuses new requests (UNAVAILABLE: the router
        sends them to another worker) and ends once its requests have, as calls would within the
        server's grace (a session is never done by itself)."""
        for session in self._sessions:
            session.stop()


@dataclass
class _Stream:
    task: asyncio.Task | None = None
    sent: int = 0  # chunks put in the outbox
    taken: int = 0  # chunks the router has taken (its last credit)
    credit: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerSession:
    def __init__(self, run: RunRequest) -> None:
        self.run = run
        self.streams: dict[int, _Stream] = {}
        self.outbox: list[tuple[worker_pb2.SessionEvent, int]] = []  # (event, its size)
        self.ready = asyncio.Event()  # the outbox has events, or the session is over
        self.reading = True  # the router may still send
        self.stopping = False  # the worker is stopping: no new request, end when idle

    async def serve(self, ups: AsyncIterator) -> AsyncIterator[worker_pb2.SessionDown]:
        """The messages down, until the router has stopped sending and every request ended;
        leaving (the call cancelled) aborts every request still running."""
        reader = asyncio.create_task(self._read(ups))
        try:
            while (self.reading and not self.stopping) or self.streams or self.outbox:
                if not self.outbox:
                    self.ready.clear()
                    await self.ready.wait()
                    continue
                yield self._take_message()
            if reader.done():  # its error, if it failed, is the call's
                reader.result()
        finally:
            reader.cancel()
            await self._abort_all()

    def _take_message(self) -> worker_pb2.SessionDown:
        """The outbox's events, up to MESSAGE_BUDGET bytes (at least one)."""
        size, taken = 0, 0
        for _, event_size in self.outbox:
            if taken and size + event_size > MESSAGE_BUDGET:
                break
            size, taken = size + event_size, taken + 1
        events = [event for event, _ in self.outbox[:taken]]
        del self.outbox[:taken]
        return worker_pb2.SessionDown(events=events)

    async def _read(self, ups: AsyncIterator) -> None:
        try:
            async for up in ups:
                for start in up.starts:
                    self._start(start)
                for credit in up.credits:
                    stream = self.streams.get(credit.stream_id)
                    if stream is not None:
                        stream.taken = credit.taken  # cumulative, in order
                        stream.credit.set()
                for stream_id in up.aborts:
                    stream = self.streams.pop(stream_id, None)
                    if stream is not None:
                        stream.task.cancel()
        finally:
            self.reading = False
            self.ready.set()

    def stop(self) -> None:
        self.stopping = True
        self.ready.set()

    def _start(self, start: worker_pb2.RequestStart) -> None:
        if self.stopping:
            self._end(start.stream_id, grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
            return
        if start.stream_id in self.streams:  # the router's bug, not the request's
            self._end(
                start.stream_id,
                grpc.StatusCode.INTERNAL,
                f"stream {start.stream_id} is already running in this session",
            )
            return
        stream = self.streams[start.stream_id] = _Stream()
        stream.task = asyncio.create_task(self._run(start.stream_id, stream, start))

    async def _run(self, stream_id: int, stream: _Stream, start: worker_pb2.RequestStart) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            chunks = self.run(start.request, dict(start.trace_headers))
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self._send_chunk(stream_id, chunk)
                    stream.sent += 1
                    while stream.sent - stream.taken >= CREDIT_WINDOW:
                        stream.credit.clear()
                        await stream.credit.wait()
        except RequestFailed as failed:
            code, details = failed.code, failed.details
        except Exception as error:  # reported as a Generate call's would be (UNKNOWN)
            log.exception("request %s failed", start.request.request_id)
            code, details = grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"
        # (CancelledError: aborted by its router, or the session ended: nothing to report.)
        if self.streams.get(stream_id) is stream:
            del self.streams[stream_id]
            self._end(stream_id, code, details)

    def _send_chunk(self, stream_id: int, chunk: worker_pb2.GenerateChunk) -> None:
        size = chunk.ByteSize()
        if size > MESSAGE_BUDGET:  # alone past a message's bytes: the request fails, not the call
            raise RequestFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a chunk of {size} bytes is more than a message carries ({MESSAGE_BUDGET}): "
                "ask for fewer logprobs",
            )
        self._put(worker_pb2.SessionEvent(stream_id=stream_id, chunk=chunk), size)

    def _end(self, stream_id: int, code: grpc.StatusCode, details: str) -> None:
        end = worker_pb2.RequestEnd(code=code.value[0], details=details)
        self._put(worker_pb2.SessionEvent(stream_id=stream_id, end=end), len(details))

    def _put(self, event: worker_pb2.SessionEvent, size: int) -> None:
        self.outbox.append((event, size))
        self.ready.set()

    async def _abort_all(self) -> None:
        """Cancel every request still running (its engine requests abort as a cancelled Generate
        call's do), within ABORT_WAIT_S."""
        tasks = [stream.task for stream in self.streams.values()]
        self.streams.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=ABORT_WAIT_S)
            if pending:
                log.warning("%d request(s) of an ended session still aborting", len(pending))
