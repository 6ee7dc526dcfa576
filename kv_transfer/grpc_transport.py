"""KV over gRPC, the portable transport, and the gRPC control channel every transport uses.

A decode rank serves the KvReceiver service (kv_transfer/kv_receiver.py). The grpc transport
sends each slice as chunks of at most 1 MiB on one long-lived client stream per destination
(one handshake, no per-slice round trip); the nccl transport uses the same kind of stream for
its rendezvous and slice descriptors. Cancels and the bare handshake are unary calls.
"""

import contextlib
import queue
import time

import grpc

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer import kv_wire_pb2_grpc as wire_grpc
from kv_transfer.compatibility import Compatibility
from kv_transfer.kv_copy import as_bytes
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import ChannelError, LayerSlice, Refused
from pdserve.settings import tls
from pdserve.settings.cluster_secret import cluster_secret

CHUNK_BYTES = 1 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
    # gRPC servers set SO_REUSEPORT by default: a receiver bound to a port another server holds
    # would share its connections, and the KV sent to the other one would be lost silently.
    ("grpc.so_reuseport", 0),
]
OUTBOX_MESSAGES = 16  # messages queued for gRPC's sending thread (16 MiB of chunks at most)
DRAIN_WAIT_S = 30.0  # longest a slice may wait to be taken by the stream (the receiver's inbox
# may hold a stream up to transport.INBOX_WAIT_S)
CONTROL_TIMEOUT_S = 2.0
_END = object()


def hello(compatibility: Compatibility) -> wire.KvMessage:
    """A stream's first message: what the receiver checks, and this cluster's secret."""
    return wire.KvMessage(
        hello=wire.Compatibility(**compatibility.to_dict(), cluster_secret=cluster_secret())
    )


def slice_chunk(piece: LayerSlice, offset: int, length: int, data: bytes = b"") -> wire.KvChunk:
    """The chunk message for bytes [offset, offset + length) of a slice (`data` only on
    grpc; the other transports carry the bytes beside the message)."""
    return wire.KvChunk(
        transfer_id=piece.transfer_id,
        layer=piece.layer,
        first_block=piece.first_block,
        num_blocks=piece.num_blocks,
        offset=offset,
        slice_bytes=piece.data.nbytes,
        data=data,
        last=piece.last,
        first_head=piece.first_head,
        num_heads=piece.num_heads,
        length=length,
        epoch=piece.epoch,
        seq=piece.seq,
        digest=piece.digest,
    )


class PushStream:
    """A PushKv client stream fed from this thread: `put` queues a message for gRPC's sending
    thread (bounded, so a slow receiver slows the sender) and raises Refused or ChannelError
    once the call has ended; `close` ends it on purpose and says how it went."""

    def __init__(self, destination: str, first: list[wire.KvMessage]) -> None:
        self.destination = destination
        self.outbox: queue.Queue = queue.Queue(maxsize=OUTBOX_MESSAGES)
        self.channel = tls.channel(destination, GRPC_OPTIONS)
        self.call = wire_grpc.KvReceiverStub(self.channel).PushKv.future(self._messages(first))

    def _messages(self, first: list[wire.KvMessage]):
        yield from first
        while True:
            message = self.outbox.get()
            if message is _END:
                return
            yield message

    def put(self, message) -> None:
        deadline = time.monotonic() + DRAIN_WAIT_S
        while True:
            self.check()
            try:
                self.outbox.put(message, timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise ChannelError(f"no progress for {DRAIN_WAIT_S:g} s") from None

    def check(self) -> None:
        if self.call.done():
            raise self._failure()

    def _failure(self) -> Exception:
        try:
            reply = self.call.result()
        except grpc.RpcError as error:
            return ChannelError(error.details() or str(error.code()))
        if not reply.accepted:
            return Refused(reply.error)
        return ChannelError("the receiver ended the stream")

    def close(self) -> None:
        """End the stream on purpose; raises what it ended with if it had failed."""
        try:
            self.put(wire.KvMessage(bye=True))
            self.put(_END)
            reply = self.call.result(timeout=DRAIN_WAIT_S)
        except grpc.RpcError as error:
            raise ChannelError(error.details() or str(error.code())) from None
        except grpc.FutureTimeoutError:
            raise ChannelError("the receiver did not end the stream") from None
        finally:
            with contextlib.suppress(queue.Full):  # gRPC's sending thread may wait on it: end it
                self.outbox.put_nowait(_END)
            self.call.cancel()
            self.channel.close()
        if not reply.accepted:
            raise Refused(reply.error)


class GrpcChannel:
    """Slices as 1 MiB chunks on a PushKv stream."""

    def __init__(self, destination: str, compatibility: Compatibility) -> None:
        handshake(destination, compatibility)  # a refusal now, not when the stream ends
        self.stream = PushStream(destination, [hello(compatibility)])

    def send(self, piece: LayerSlice) -> None:
        memory = as_bytes(piece.data.ready())
        total = len(memory)
        for offset in range(0, max(total, 1), CHUNK_BYTES):
            data = bytes(memory[offset : offset + CHUNK_BYTES])
            self.stream.put(wire.KvMessage(chunk=slice_chunk(piece, offset, len(data), data)))

    def close(self) -> None:
        self.stream.close()


def rank_address(address: str, rank: int) -> str:
    """Tensor-parallel rank r of a decode worker receives on its KV port + r."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def cancel_transfer(
    destination: str,
    transfer_id: str,
    cancel: Cancel,
    ranks: int = 1,
    timeout: float = CONTROL_TIMEOUT_S,
) -> None:
    """Tell the first `ranks` ranks of a decode worker at `destination` that a transfer's KV
    will not come (its producer failed, or its handshake was refused)."""
    for rank in range(ranks):
        with tls.channel(rank_address(destination, rank)) as channel:
            wire_grpc.KvReceiverStub(channel).CancelTransfer(
                wire.CancelTransferRequest(
                    transfer_id=transfer_id,
                    reason=cancel.reason,
                    cluster_secret=cluster_secret(),
                    failure=cancel.failure,
                ),
                timeout=timeout,
            )


def cancel_failure(request: wire.CancelTransferRequest) -> Failure:
    """The Failure a CancelTransfer names (`cancelled` if none, or unknown: an older sender)."""
    try:
        return Failure(request.failure or Failure.CANCELLED)
    except ValueError:  # a kind this worker does not know
        return Failure.CANCELLED


def handshake(destination: str, compatibility: Compatibility) -> None:
    """The bare handshake; raises Refused naming the mismatch, ChannelError if unreachable."""
    try:
        with tls.channel(destination) as channel:
            reply = wire_grpc.KvReceiverStub(channel).Handshake(
                hello(compatibility).hello, timeout=CONTROL_TIMEOUT_S
            )
    except grpc.RpcError as error:
        raise ChannelError(error.details() or str(error.code())) from None
    if not reply.accepted:
        raise Refused(reply.error)
