"""The router's side of a worker Session: all of this router's requests to one worker over one
long-lived gRPC stream (the worker's side, and why: pdserve/worker/session.py).

Requests put what they send (a start, a credit, an abort) in the next message up, and one writer
task sends it; nothing a request's own task does awaits the call, because a write cancelled
midway cancels the whole call. One reader task hands each event down to its request's queue.
When the call ends (the worker went away, or its connection broke), every request on it ends
with that status, UNAVAILABLE when none (the retry and migration paths then act as on a failed
Generate call); the worker's client opens a new session for the next request.
"""

import asyncio
import itertools
import logging
from dataclasses import dataclass

import grpc

from pdserve.protocol import CREDIT_WINDOW, worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.router")
CREDIT_EVERY = CREDIT_WINDOW // 2  # chunks a request takes between two credits it sends
STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


@dataclass(frozen=True)
class Ended:
    """A request's end: OK when it finished, else why not (a gRPC status)."""

    code: grpc.StatusCode
    details: str = ""


class WorkerSession:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub, metadata: tuple, worker: str) -> None:
        self.worker = worker  # its name, for the log
        self.call = stub.Session(metadata=metadata)
        self.queues: dict[int, asyncio.Queue] = {}  # stream id -> its chunks, then its Ended
        self.stream_ids = itertools.count(1)
        self.up = worker_pb2.SessionUp()  # the next message up
        self.up_ready = asyncio.Event()
        self.ended: Ended | None = None  # the call's end: no request can start on it
        self.reader = asyncio.create_task(self._read())
        self.writer = asyncio.create_task(self._write())

    def start(self, request: worker_pb2.GenerateRequest, trace_headers: dict[str, str]):
        """Sends a request: its stream id, and the queue its chunks, then its Ended, arrive in."""
        stream_id, queue = next(self.stream_ids), asyncio.Queue()
        if self.ended is not None:  # the caller's client opens a new session for the next one
            queue.put_nowait(self.ended)
            return stream_id, queue
        self.queues[stream_id] = queue
        self.up.starts.add(stream_id=stream_id, request=request, trace_headers=trace_headers)
        self.up_ready.set()
        return stream_id, queue

    def credit(self, stream_id: int, taken: int) -> None:
        """The request's consumer has taken `taken` chunks: the worker may send more."""
        if stream_id in self.queues:
            self.up.credits.add(stream_id=stream_id, taken=taken)
            self.up_ready.set()

    def abort(self, stream_id: int) -> None:
        """The request's consumer is done with it: a request still running (neither the worker
        nor the session ended it) is aborted on the worker, its late events dropped here."""
        if self.queues.pop(stream_id, None) is not None and self.ended is None:
            self.up.aborts.append(stream_id)
            self.up_ready.set()

    async def _write(self) -> None:
        try:
            while True:
                await self.up_ready.wait()
                self.up_ready.clear()
                up, self.up = self.up, worker_pb2.SessionUp()
                await self.call.write(up)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: the reader reports it to every request
        except Exception:
            log.exception("writing to the session with %s failed: it ends", self.worker)
            self.call.cancel()  # the reader ends every request on it

    async def _read(self) -> None:
        ended = Ended(grpc.StatusCode.UNAVAILABLE, f"the session with {self.worker} was closed")
        try:
            while True:
                down = await self.call.read()
                if down is grpc.aio.EOF:
                    ended = Ended(grpc.StatusCode.UNAVAILABLE, "the worker ended the session")
                    return
                for event in down.events:
                    queue = self.queues.get(event.stream_id)
                    if queue is None:  # aborted by its consumer
                        continue
                    if event.HasField("chunk"):
                        queue.put_nowait(event.chunk)
                    else:
                        del self.queues[event.stream_id]
                        end = event.end
                        code = STATUS_BY_CODE.get(end.code, grpc.StatusCode.UNKNOWN)
                        queue.put_nowait(Ended(code, end.details))
        except grpc.aio.AioRpcError as error:
            ended = Ended(error.code(), error.details() or "")
        finally:
            self.ended = ended
            if self.queues:
                log.warning(
                    "session with %s ended (%s: %s): %d request(s) on it end too",
                    self.worker,
                    ended.code.name,
                    ended.details,
                    len(self.queues),
                )
            for queue in self.queues.values():
                queue.put_nowait(ended)
            self.queues.clear()
            self.writer.cancel()

    async def close(self) -> None:
        self.call.cancel()
        for task in (self.reader, self.writer):
            task.cancel()
        await asyncio.gather(self.reader, self.writer, return_exceptions=True)
