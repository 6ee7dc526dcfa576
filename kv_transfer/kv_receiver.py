"""A decode rank's KV receiver: every transport's receiving end, feeding one inbox.

It serves the KvReceiver gRPC service on the rank's KV port (grpc chunks, the nccl rendezvous
and slice descriptors, cancels, the bare handshake) and listens for shm senders on the abstract
Unix socket named after the same address. The decode worker's KV loader `take()`s what has
arrived each engine step.
"""

import logging
import threading
from collections.abc import Callable
from concurrent import futures
from functools import partial

import grpc
import torch

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer import kv_wire_pb2_grpc as wire_grpc
from kv_transfer.compatibility import NO_HELLO, NO_SECRET, Compatibility, check_hello
from kv_transfer.grpc_transport import GRPC_OPTIONS, cancel_failure
from kv_transfer.log_limit import LogLimit
from kv_transfer.memory_budget import INBOX_BYTES
from kv_transfer.nccl_transport import NcclReceiving
from kv_transfer.shm_transport import ShmListener
from kv_transfer.transfer_report import Cancel
from kv_transfer.transport import (
    INBOX_WAIT_S,
    Inbox,
    SliceAssembler,
    bind_device,
)
from pdserve.settings import tls
from pdserve.settings.cluster_secret import cluster_secret, secret_matches

log = logging.getLogger("pdserve.kv")
MAX_STREAMS = 32  # concurrent sending channels (prefill ranks) this rank serves
HELLO_STREAMS = 16  # streams waiting for their hello at once (a sender's comes with its stream)
HELLO_WAIT_S = 2.0  # longest a stream may take to say hello (before it proved anything)
CONTROL_THREADS = 8  # threads that only Handshake and CancelTransfer can take
QUEUED_CALLS = 64  # calls that may wait for a thread; past them gRPC refuses at once
TOO_MANY_STREAMS = f"refused: this rank serves {MAX_STREAMS} KV streams at most"
NO_HELLO_IN_TIME = f"a KV stream must say hello within {HELLO_WAIT_S:g} s"
DISPLACED = "a KV stream waiting for its hello, displaced by a newer one"
_GIVEN_UP = object()  # what _hello returns for a stream it gave up on


class HelloGate:
    """The streams waiting for their hello, at most `slots`: a new one when all are taken
    displaces the one that has waited longest. A sender's hello comes with its stream (it is
    read at once), so a stream that waits is not a sender's, and streams that never say hello
    cannot keep a sender's out."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.lock = threading.Lock()
        self.waiting: dict[object, Callable[[], None]] = {}  # oldest first: its give-up

    def enter(self, token: object, give_up: Callable[[], None]) -> Callable[[], None] | None:
        """Admit the stream `token`; the give-up of the one it displaced, to be called."""
        with self.lock:
            displaced = None
            if len(self.waiting) >= self.slots:
                displaced = self.waiting.pop(next(iter(self.waiting)))
            self.waiting[token] = give_up
        return displaced

    def leave(self, token: object) -> None:
        with self.lock:
            self.waiting.pop(token, None)


class KvReceiver(wire_grpc.KvReceiverServicer):
    """What a peer can hold before it has proved anything is bounded: a PushKv stream must
    send its hello (the secret checked) within HELLO_WAIT_S, at most HELLO_STREAMS may be
    waiting to (HelloGate: the longest waiting one makes room for a new one), and at most
    MAX_STREAMS accepted ones run (others are refused at once, RESOURCE_EXHAUSTED). The
    server's threads are those plus CONTROL_THREADS, so Handshake and CancelTransfer always
    find one. Refusals are logged at most once per kind every log_limit.LOG_EVERY_S."""

    def __init__(
        self,
        compatibility: Compatibility,
        inbox_bytes: int = INBOX_BYTES,
        inbox_wait_s: float = INBOX_WAIT_S,
        integrity: bool = True,
        max_slice_bytes: int = 0,
    ) -> None:
        """`integrity`: check every slice's digest where it lands (kv_transfer/integrity.py);
        `max_slice_bytes`: the largest slice a sender may announce (see Inbox)."""
        self.compatibility = compatibility
        self.secret = cluster_secret()  # what every stream and cancel must carry
        self.inbox = Inbox(inbox_bytes, inbox_wait_s, integrity, max_slice_bytes)
        self.device = torch.device("cpu")  # where nccl receives: the rank's cache device
        self.host = "127.0.0.1"
        self.server = None
        self.shm: ShmListener | None = None
        self.hello_gate = HelloGate(HELLO_STREAMS)
        self.stream_slots = threading.BoundedSemaphore(MAX_STREAMS)
        self.refusals = LogLimit(log)

    def start(self, host: str, port: int, advertised_host: str = "") -> int:
        """Listen on host:port (0: any free port); shm senders reach it at
        `advertised_host`:port. Returns the port."""
        # Every thread a stream can hold, and more: streams never starve the control calls.
        threads = MAX_STREAMS + HELLO_STREAMS + CONTROL_THREADS
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-receive"),
            options=GRPC_OPTIONS,
            maximum_concurrent_rpcs=threads + QUEUED_CALLS,
        )
        wire_grpc.add_KvReceiverServicer_to_server(self, self.server)
        bound = tls.add_port(self.server, f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"cannot listen for KV on {host}:{port}")
        self.host = advertised_host or host
        self.shm = ShmListener(
            f"{self.host}:{bound}",
            self.compatibility,
            self.secret,
            self.inbox,
            bind=lambda: bind_device(self.device),
        )
        self.shm.start()
        self.server.start()
        return bound

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1)
        if self.shm is not None:
            self.shm.stop()
        self.inbox.drop_all()

    def take(self):
        return self.inbox.take()

    def _answer(self, first, peer: str) -> wire.PushKvReply:
        error = check_hello(first, self.compatibility, self.secret)
        if error:
            self.refusals.error(refusal_kind(error), "KV hello from %s: %s", peer, error)
        return wire.PushKvReply(accepted=not error, error=error)

    def Handshake(self, request, context):
        return self._answer(wire.KvMessage(hello=request), context.peer())

    def PushKv(self, request_iterator, context):
        bind_device(self.device)  # a pool thread: its CUDA calls (pinned buffers) go there
        peer = context.peer()
        first = self._hello(request_iterator, context, peer)
        if first is _GIVEN_UP or not context.is_active():  # cancelled: by us, or by its peer
            return wire.PushKvReply(accepted=False, error=NO_HELLO_IN_TIME)
        answer = self._answer(first, peer)
        if not answer.accepted:
            return answer
        if not self.stream_slots.acquire(blocking=False):
            self.refusals.error("stream-slots", "KV stream from %s: %s", peer, TOO_MANY_STREAMS)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_STREAMS)
        try:
            return self._receive(request_iterator, context)
        finally:
            self.stream_slots.release()

    def _hello(self, request_iterator, context, peer: str):
        """The stream's first message; None when it ended or failed first; _GIVEN_UP when
        none came within HELLO_WAIT_S or a newer stream displaced this one (the call is
        cancelled then)."""
        lock = threading.Lock()
        why: list[str] = []  # why this stream was given up on, once it was
        said_hello: list[bool] = []  # once its first message came (or none will): too late

        def give_up(reason: str) -> None:
            with lock:
                if why or said_hello:
                    return
                why.append(reason)
            context.cancel()

        token = object()
        displaced = self.hello_gate.enter(token, partial(give_up, DISPLACED))
        timer = threading.Timer(HELLO_WAIT_S, give_up, [NO_HELLO_IN_TIME])
        timer.daemon = True
        timer.start()
        try:
            if displaced is not None:
                displaced()
            try:
                first = next(request_iterator, None)
            except grpc.RpcError:
                first = None
            with lock:
                said_hello.append(True)
                if not why:
                    return first
        finally:
            timer.cancel()
            self.hello_gate.leave(token)
        kind = "hello-late" if why[0] == NO_HELLO_IN_TIME else "hello-displaced"
        self.refusals.error(kind, "KV stream from %s: %s", peer, why[0])
        return _GIVEN_UP

    def _receive(self, request_iterator, context):
        log.info("KV stream from %s accepted", context.peer())
        assembler = SliceAssembler(self.inbox, "grpc", self.compatibility)
        nccl: NcclReceiving | None = None
        try:
            for message in request_iterator:
                body = message.WhichOneof("body")
                if body == "chunk":
                    assembler.add(message.chunk, message.chunk.data)
                elif body == "nccl_open":
                    nccl = NcclReceiving(message.nccl_open, self.host, self.device)
                    # the sender gone: a receive waiting on it fails now, not at its deadline
                    context.add_callback(partial(nccl.abort, "the KV stream ended"))
                    assembler.transport = message.nccl_open.backend  # nccl or gloo
                    log.info(
                        "KV %s group with %s joined", message.nccl_open.backend, context.peer()
                    )
                    # The rest of the stream is slice descriptors, each slice's bytes over the
                    # group, up to a window of receives posted at once.
                    if nccl.serve(
                        request_iterator,
                        admit=partial(self._admit_nccl, assembler),
                        reserve=self.inbox.reserve,  # its room, before its device memory
                        unreserve=self.inbox.unreserve,
                        buffer=self.inbox.buffer,
                        deliver=partial(assembler.deliver, reserved=True),
                        has_room=self.inbox.has_room,
                    ):
                        return wire.PushKvReply(accepted=True)
                    break
                elif body == "bye":
                    return wire.PushKvReply(accepted=True)
        except Exception as failure:  # whatever it was, the stream's transfers are cancelled
            log.error("KV stream from %s failed: %s", context.peer(), failure)
            assembler.abandon(f"the prefill worker's KV stream failed: {failure}")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(failure))
        finally:
            if nccl is not None:
                nccl.close()
        # The stream ended without a bye: its sender went away mid-stream.
        assembler.abandon("the prefill worker's KV stream ended mid-transfer")
        return wire.PushKvReply(accepted=True)

    @staticmethod
    def _admit_nccl(assembler: SliceAssembler, chunk) -> None:
        """An nccl slice's descriptor, checked before its memory is made."""
        assembler.check(chunk, chunk.length)
        assembler.carried.begin(chunk.transfer_id)  # its bytes may never come

    def CancelTransfer(self, request, context):
        if not secret_matches(request.cluster_secret, self.secret):
            self.refusals.error(
                "cancel-secret",
                "a KV cancel without this cluster's secret from %s: ignored",
                context.peer(),
            )
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_SECRET)
        failure = cancel_failure(request)
        self.inbox.cancel(request.transfer_id, Cancel(failure, request.reason))
        return wire.CancelTransferReply(known=True)


def refusal_kind(error: str) -> str:
    """A refused hello's kind (a fixed word: what the log limit counts by)."""
    if error == NO_SECRET:
        return "hello-secret"
    if error == NO_HELLO:
        return "hello-missing"
    return "hello-incompatible"
