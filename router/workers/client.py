"""The router's gRPC client for one worker, with deadlines on every call. Requests go over one
session per worker (router/workers/session.py).

A request's failure (its gRPC status) becomes an OpenAIError here, so the HTTP layer only ever
sees one error type: INVALID_ARGUMENT from a worker is the client's fault (400), UNAVAILABLE (or
CANCELLED, which only the worker's side sends: a stopping worker's streams) means the worker is
not there (503), a passed deadline is a timeout (504), KV_TRANSFER_FAILED (ABORTED) means the
prompt's KV did not reach a decode worker (502 kv_transfer_failed), the rest, engine errors
included, is a worker failure (502 worker_error).
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from pdserve.core import tracing
from pdserve.core.kinds import Role
from pdserve.protocol import GRPC_OPTIONS, worker_pb2, worker_pb2_grpc
from pdserve.protocol.status import KV_TRANSFER_FAILED
from pdserve.settings import tls
from pdserve.settings.cluster_secret import secret_metadata
from router.http.errors import (
    OpenAIError,
    invalid_request,
    kv_transfer_failed,
    request_timeout,
    worker_failed,
    worker_unavailable,
)
from router.workers.load import WorkerLoad
from router.workers.session import CREDIT_EVERY, Ended, WorkerSession

log = logging.getLogger("pdserve.router")
CONTROL_TIMEOUT_S = 5.0


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self.role = ""  # the pool it serves: its own, or the one the router gave a flex worker
        self.flex = False  # can play either role (router/workers/flex_roles.py assigns it)
        # Who it is: its last READY Health reply, kept whole (until then, named by its address).
        self.identity = worker_pb2.HealthReply(worker_id=address)
        self.users = 0  # requests using it now (in a call, or about to call it): see in_use
        self.load = WorkerLoad()  # what it reports, and what this router sent since
        self._session: WorkerSession | None = None
        self._closed = False
        self.metadata = secret_metadata()  # every call carries the cluster secret

    @property
    def stub(self) -> worker_pb2_grpc.WorkerStub:
        """Made on first use: a grpc.aio channel belongs to the event loop that creates it."""
        if self._stub is None:
            self._channel = tls.aio_channel(self.address, GRPC_OPTIONS)
            self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        return self._stub

    async def health(self, timeout: float = CONTROL_TIMEOUT_S) -> worker_pb2.HealthReply:
        reply = await self.stub.Health(
            worker_pb2.HealthRequest(), timeout=timeout, metadata=self.metadata
        )
        if reply.state == worker_pb2.HealthReply.READY:
            self.identity, self.flex = reply, reply.role == Role.FLEX
            if not self.flex:
                self.role = reply.role
        return reply

    async def stats(
        self, request: worker_pb2.StatsRequest | None = None, timeout: float = CONTROL_TIMEOUT_S
    ) -> worker_pb2.StatsReply:
        request = request if request is not None else worker_pb2.StatsRequest()
        return await self.stub.Stats(request, timeout=timeout, metadata=self.metadata)

    async def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        """Best effort, on a decode worker: its receivers learn that a transfer's KV will not
        come, so its kv failure policy applies now rather than at the KV deadline (which still
        applies when this fails)."""
        try:
            await self.stub.CancelTransfer(
                worker_pb2.CancelTransferRequest(transfer_id=transfer_id, reason=reason),
                timeout=CONTROL_TIMEOUT_S,
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as error:
            log.warning(
                "could not cancel transfer %s on %s: %s: %s",
                transfer_id,
                self.address,
                error.code().name,
                error.details(),
            )
        except grpc.aio.UsageError:  # the worker left the pool: its deadline applies
            log.info(
                "could not cancel transfer %s on %s: its channel is closed",
                transfer_id,
                self.address,
            )

    @property
    def session(self) -> WorkerSession:
        """The session requests to this worker go over: opened on first use, and again after
        one ends (the worker restarted, its connection broke)."""
        if self._session is None or self._session.ended is not None:
            self._session = WorkerSession(self.stub, self.metadata, self.address)
        return self._session

    async def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float
    ) -> AsyncIterator[worker_pb2.GenerateChunk]:
        """Stream a request's chunks, over this worker's session. Leaving early (break, cancel,
        error, the deadline) aborts it on the worker."""
        if self._closed:  # it left the pools while the request waited for it (never a 500)
            raise worker_unavailable(f"worker {self.identity.worker_id} left the pools")
        span = tracing.tracer().start_span(
            _call_name(request),
            kind=trace.SpanKind.CLIENT,
            attributes={
                "pdserve.worker": self.identity.worker_id,
                "pdserve.request_id": request.request_id,
            },
        )
        session = self.session
        stream_id, queue = session.start(request, tracing.trace_headers(span))
        deadline = asyncio.get_running_loop().call_later(
            timeout, queue.put_nowait, Ended(grpc.StatusCode.DEADLINE_EXCEEDED)
        )
        taken = 0
        self.users += 1
        self.load.sent(len(request.prompt_token_ids))
        try:
            while not isinstance(item := await queue.get(), Ended):
                yield item
                taken += 1
                if taken % CREDIT_EVERY == 0:
                    session.credit(stream_id, taken)
            ended = item
            if ended.code != grpc.StatusCode.OK:
                span.set_status(trace.StatusCode.ERROR, f"{ended.code.name}: {ended.details}")
                raise self._to_openai_error(ended, timeout)
        finally:
            deadline.cancel()
            span.end()
            self.users -= 1
            session.abort(stream_id)  # unless the worker ended it, or the session did

    def _to_openai_error(self, ended: Ended, timeout: float) -> OpenAIError:
        code, details = ended.code, ended.details
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid_request(details)
        if code == KV_TRANSFER_FAILED:  # an engine error is ENGINE_FAILED: a worker error
            return kv_transfer_failed(f"worker {self.identity.worker_id}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return request_timeout(timeout)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            # CANCELLED is the worker's doing (a request the router leaves is aborted, never
            # cancelled): a stopping worker ended it, so it is gone as UNAVAILABLE is.
            return worker_unavailable(f"worker {self.identity.worker_id} is unavailable: {details}")
        return worker_failed(f"worker {self.identity.worker_id} failed: {code.name}: {details}")

    @contextlib.contextmanager
    def in_use(self):
        """Held by a request between choosing this worker and calling it (a decode worker
        while the prefill leg runs): the pool does not close a leaving worker's channel under
        it."""
        self.users += 1
        try:
            yield self
        finally:
            self.users -= 1

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
        if self._channel is not None:
            await self._channel.close()


def _call_name(request: worker_pb2.GenerateRequest) -> str:
    """The span of a call: a prefill leg sends the prompt's KV, a decode leg receives it."""
    if not request.HasField("kv"):
        return "pdserve.generate"
    return "pdserve.prefill_leg" if request.kv.send_to else "pdserve.decode_leg"
