"""KV over gRPC: a sender (prefill worker) and a receiver (decode worker), in chunks ≤ 1 MiB.

The sender keeps one long-lived client stream per destination (a decode rank), fed from a
queue by a background thread, so `save_kv_layer` only stages a layer's slices and returns while
the forward pass goes on. The receiver assembles each layer slice from its chunks and hands
whole slices to the decode worker's KV loader, which copies them into the KV cache on vLLM's
own thread.
Every stream starts with the compatibility handshake; a mismatched pair is refused.
"""

import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer import kv_wire_pb2_grpc as wire_grpc
from kv_transfer.compatibility import Compatibility, describe_refusal, mismatches
from kv_transfer.host_staging import Staged
from kv_transfer.kv_copy import as_bytes

log = logging.getLogger("pdserve.kv")

CHUNK_BYTES = 1 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
    # gRPC servers set SO_REUSEPORT by default: a receiver bound to a port another server holds
    # would share its connections, and the KV sent to the other one would be lost silently.
    ("grpc.so_reuseport", 0),
]
_CLOSE = object()


@dataclass(frozen=True)
class LayerSlice:
    """One layer's KV for consecutive blocks and heads of one transfer: a wire tensor
    [num_blocks, num_heads, block_size, 2, head_size] as raw bytes. On the sending side `data`
    is staged (kv_transfer/host_staging.Staged: its bytes may still be on their way from the
    device); on the receiving side a bytearray, which the cache copy reads without a copy."""

    transfer_id: str
    layer: int
    first_block: int
    num_blocks: int
    first_head: int  # global KV head index
    num_heads: int
    data: object  # Staged when sent, bytearray when received
    last: bool  # the sender's last slice of this layer for the transfer
    received_at: float = 0.0  # receiver's monotonic clock, when the slice was complete


def chunks_of(piece: LayerSlice):
    """The slice's chunk messages; a staged slice's host buffer is released after the last, or
    when the stream stops reading midway (gRPC drops the generator)."""
    data = piece.data
    try:
        memory = as_bytes(data.host()) if isinstance(data, Staged) else memoryview(data)
        total = len(memory)
        for offset in range(0, max(total, 1), CHUNK_BYTES):
            yield wire.KvMessage(
                chunk=wire.KvChunk(
                    transfer_id=piece.transfer_id,
                    layer=piece.layer,
                    first_block=piece.first_block,
                    num_blocks=piece.num_blocks,
                    offset=offset,
                    slice_bytes=total,
                    data=bytes(memory[offset : offset + CHUNK_BYTES]),
                    last=piece.last,
                    first_head=piece.first_head,
                    num_heads=piece.num_heads,
                )
            )
    finally:
        if isinstance(data, Staged):
            data.release()


class KvSender:
    """Sends layer slices to decode workers from one background thread per destination, so
    the forward pass never waits on the network. Each destination has one long-lived client
    stream (one handshake, no per-slice round trip). When a stream ends early, every slice
    still queued for it is released, and if the receiver refused the handshake, each transfer
    the stream carried is cancelled with the refusal's reason, so the decode worker applies its
    policy at once rather than at its deadline. The next slice opens a new stream."""

    def __init__(self, compatibility: Compatibility) -> None:
        self.hello = wire.KvMessage(hello=wire.Compatibility(**compatibility.to_dict()))
        self.queues: dict[str, queue.Queue] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()

    def send(self, destination: str, piece: LayerSlice) -> None:
        with self.lock:
            pending = self.queues.get(destination)
            if pending is None:  # no stream yet, or the last one ended
                pending = self.queues[destination] = queue.Queue()
                thread = threading.Thread(
                    target=self._stream,
                    args=(destination, pending),
                    name=f"kv-send-{destination}",
                    daemon=True,
                )
                self.threads[destination] = thread
                thread.start()
            pending.put(piece)

    def _stream(self, destination: str, pending: queue.Queue) -> None:
        carried: set[str] = set()

        def messages():
            yield self.hello
            while (piece := pending.get()) is not _CLOSE:
                carried.add(piece.transfer_id)
                yield from chunks_of(piece)

        refusal = None
        log.info("KV stream to %s opening", destination)
        try:
            with grpc.insecure_channel(destination, options=GRPC_OPTIONS) as channel:
                reply = wire_grpc.KvReceiverStub(channel).PushKv(messages())
            if not reply.accepted:
                refusal = reply.error
                log.error("KV stream to %s refused: %s", destination, refusal)
        except grpc.RpcError as error:
            log.error("KV stream to %s failed: %s", destination, error.details())
        finally:
            with self.lock:  # later slices for this destination go to a new stream
                if self.queues.get(destination) is pending:
                    del self.queues[destination]
            carried = carried | _release_queued(pending)
            pending.put(_CLOSE)  # gRPC's thread may still wait on the queue: let it end
        if refusal is not None:
            for transfer_id in sorted(carried):
                try:
                    cancel_transfer(destination, transfer_id, refusal)
                except grpc.RpcError as error:
                    log.warning("could not cancel transfer %s: %s", transfer_id, error.details())

    def cancel(self, destination: str, transfer_id: str, reason: str) -> None:
        """Tell the receiver a transfer will not complete, from a thread of its own (the
        caller is the forward pass)."""

        def call() -> None:
            try:
                cancel_transfer(destination, transfer_id, reason)
            except grpc.RpcError as error:
                log.warning("could not cancel transfer %s: %s", transfer_id, error.details())

        threading.Thread(target=call, name=f"kv-cancel-{transfer_id}", daemon=True).start()

    def close(self) -> None:
        with self.lock:
            for pending in self.queues.values():
                pending.put(_CLOSE)
        for thread in list(self.threads.values()):
            thread.join(timeout=5)


def _release_queued(pending: queue.Queue) -> set[str]:
    """Empty a dead stream's queue, releasing staged slices; their transfer ids."""
    transfer_ids = set()
    while True:
        try:
            piece = pending.get_nowait()
        except queue.Empty:
            return transfer_ids
        if piece is not _CLOSE:
            transfer_ids.add(piece.transfer_id)
            if isinstance(piece.data, Staged):
                piece.data.release()


class KvReceiver(wire_grpc.KvReceiverServicer):
    """Receives layer slices for the decode worker; `take()` hands over the complete ones."""

    def __init__(self, compatibility: Compatibility) -> None:
        self.compatibility = compatibility
        self.lock = threading.Lock()
        self.complete: list[LayerSlice] = []
        self.cancelled: dict[str, str] = {}  # transfer id -> reason
        self.server = None

    def start(self, host: str, port: int) -> int:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
        wire_grpc.add_KvReceiverServicer_to_server(self, self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"cannot listen for KV on {host}:{port}")
        self.server.start()
        return bound

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1)

    def take(self) -> tuple[list[LayerSlice], dict[str, str]]:
        with self.lock:
            complete, self.complete = self.complete, []
            cancelled, self.cancelled = self.cancelled, {}
        return complete, cancelled

    def PushKv(self, request_iterator, context):
        hello = next(request_iterator, None)
        if hello is None or not hello.HasField("hello"):
            return wire.PushKvReply(accepted=False, error="a KV stream must start with hello")
        producer = Compatibility.from_message(hello.hello)
        if mismatches(producer, self.compatibility):
            error = describe_refusal(producer, self.compatibility)
            log.error("%s", error)
            return wire.PushKvReply(accepted=False, error=error)
        log.info("KV stream from %s accepted", context.peer())
        buffers: dict[tuple, bytearray] = {}
        for message in request_iterator:
            chunk = message.chunk
            key = (chunk.transfer_id, chunk.layer, chunk.first_block, chunk.first_head)
            buffer = buffers.setdefault(key, bytearray(chunk.slice_bytes))
            buffer[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
            if chunk.offset + len(chunk.data) >= chunk.slice_bytes:
                del buffers[key]
                with self.lock:
                    self.complete.append(
                        LayerSlice(
                            chunk.transfer_id,
                            chunk.layer,
                            chunk.first_block,
                            chunk.num_blocks,
                            chunk.first_head,
                            chunk.num_heads,
                            buffer,
                            chunk.last,
                            time.monotonic(),
                        )
                    )
        return wire.PushKvReply(accepted=True)

    def CancelTransfer(self, request, context):
        with self.lock:
            self.cancelled[request.transfer_id] = request.reason or "cancelled"
        return wire.CancelTransferReply(known=True)


def rank_address(address: str, rank: int) -> str:
    """Tensor-parallel rank r of a decode worker receives on its KV port + r."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def cancel_transfer(
    destination: str, transfer_id: str, reason: str, ranks: int = 1, timeout: float = 2.0
) -> None:
    """Tell the first `ranks` ranks of a decode worker at `destination` that a transfer's KV
    will not come (its producer failed, or its handshake was refused)."""
    for rank in range(ranks):
        with grpc.insecure_channel(rank_address(destination, rank)) as channel:
            wire_grpc.KvReceiverStub(channel).CancelTransfer(
                wire.CancelTransferRequest(transfer_id=transfer_id, reason=reason), timeout=timeout
            )
