"""A decode rank's KV receiver: every transport's receiving end, feeding one inbox.

It serves the KvReceiver gRPC service on the rank's KV port (grpc chunks, the nccl rendezvous
and slice descriptors, cancels, the bare handshake) and listens for shm senders on the abstract
Unix socket named after the same address. The decode worker's KV loader `take()`s what has
arrived each engine step.
"""

import logging
from concurrent import futures
from functools import partial

import grpc
import torch

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer import kv_wire_pb2_grpc as wire_grpc
from kv_transfer.compatibility import NO_SECRET, Compatibility, check_hello
from kv_transfer.grpc_transport import GRPC_OPTIONS
from kv_transfer.memory_budget import INBOX_BYTES
from kv_transfer.nccl_transport import NcclReceiving
from kv_transfer.shm_transport import ShmListener
from kv_transfer.transport import INBOX_WAIT_S, ChannelError, Inbox, SliceAssembler
from pdserve.settings import tls
from pdserve.settings.cluster_secret import cluster_secret, secret_matches

log = logging.getLogger("pdserve.kv")
MAX_STREAMS = 32  # concurrent sending channels (prefill ranks) this rank serves


class KvReceiver(wire_grpc.KvReceiverServicer):
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

    def start(self, host: str, port: int, advertised_host: str = "") -> int:
        """Listen on host:port (0: any free port); shm senders reach it at
        `advertised_host`:port. Returns the port."""
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=MAX_STREAMS), options=GRPC_OPTIONS
        )
        wire_grpc.add_KvReceiverServicer_to_server(self, self.server)
        bound = tls.add_port(self.server, f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"cannot listen for KV on {host}:{port}")
        self.host = advertised_host or host
        self.shm = ShmListener(f"{self.host}:{bound}", self.compatibility, self.secret, self.inbox)
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

    def _answer(self, first) -> wire.PushKvReply:
        error = check_hello(first, self.compatibility, self.secret)
        if error:
            log.error("%s", error)
        return wire.PushKvReply(accepted=not error, error=error)

    def Handshake(self, request, context):
        return self._answer(wire.KvMessage(hello=request))

    def PushKv(self, request_iterator, context):
        answer = self._answer(next(request_iterator, None))
        if not answer.accepted:
            return answer
        log.info("KV stream from %s accepted", context.peer())
        assembler = SliceAssembler(self.inbox, "grpc", self.compatibility)
        nccl: NcclReceiving | None = None
        try:
            for message in request_iterator:
                body = message.WhichOneof("body")
                if body == "chunk" and nccl is None:
                    assembler.add(message.chunk, message.chunk.data)
                elif body == "chunk":
                    chunk = message.chunk
                    if chunk.length != chunk.slice_bytes:
                        raise ChannelError(
                            f"an nccl slice of {chunk.length} bytes said {chunk.slice_bytes}"
                        )
                    assembler.check(chunk, chunk.length)  # before anything is allocated
                    assembler.carried.begin(chunk.transfer_id)  # its bytes may never come
                    assembler.deliver(chunk, nccl.receive(chunk.length, self.inbox.buffer))
                elif body == "nccl_open":
                    if nccl is not None:
                        raise ChannelError("a second nccl_open on one stream")
                    nccl = NcclReceiving(message.nccl_open, self.host, self.device)
                    # the sender gone: a receive waiting on it fails now, not at its deadline
                    context.add_callback(partial(nccl.abort, "the KV stream ended"))
                    assembler.transport = message.nccl_open.backend  # nccl or gloo
                    log.info(
                        "KV %s group with %s joined", message.nccl_open.backend, context.peer()
                    )
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

    def CancelTransfer(self, request, context):
        if not secret_matches(request.cluster_secret, self.secret):
            log.error("a KV cancel without this cluster's secret from %s: ignored", context.peer())
            context.abort(grpc.StatusCode.UNAUTHENTICATED, NO_SECRET)
        self.inbox.cancel(request.transfer_id, request.reason)
        return wire.CancelTransferReply(known=True)
