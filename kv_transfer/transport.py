"""What every KV transport shares: the layer slice, the sender's per-destination threads, the
receiver's bounded inbox and slice assembly. Which transport a worker pair uses is chosen from
their Health (pdserve/protocol/transport_choice.py).

A transport moves layer slices from a prefill rank to a decode rank. Three implement
`Channel` (the sending end of one destination): `grpc` (kv_transfer/grpc_transport.py,
portable across hosts), `nccl` (kv_transfer/nccl_transport.py: a pairwise torch.distributed
group, NCCL on CUDA, gloo on CPU) and `shm` (kv_transfer/shm_transport.py: shared memory on one
host). The receiving ends all feed one `Inbox` (kv_transfer/kv_receiver.py), which the decode
worker's KV loader empties each engine step. All start with the compatibility handshake; all
share the cancel and deadline semantics: a transfer whose channel fails or is refused is
cancelled at once on the receiver, so the decode worker applies its policy then.

Threads: every pdserve thread that may touch CUDA (a sender's thread, a receiver's stream and
shm connection threads) first binds its rank's device (`bind_device`): a fresh thread's CUDA
calls go to GPU 0, and would make a context there for another rank (~0.5 GiB each, outside the
memory check).

Backpressure: the sender's bytes in flight are bounded where they are staged
(kv_transfer/host_staging.py), the receiver's by the inbox; a full inbox stops reading, which
stalls the sender's channel, which fills the sender's budget, which makes the forward pass wait
and, past its deadline, cancel the transfer. Memory never grows without limit.

Plain Python and torch: no vLLM, HTTP or routing here.
"""

import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from kv_transfer.integrity import Damage, as_tensor, slice_digest
from kv_transfer.memory_budget import INBOX_BYTES
from kv_transfer.transfer_report import Cancel, Failure
from pdserve.core.kinds import Transport

log = logging.getLogger("pdserve.kv")

TRANSPORTS = tuple(Transport)
IDLE_CLOSE_S = 60.0  # a channel with nothing to send this long is closed (its peer may be gone)
LIVENESS_S = 1.0  # how often an idle channel kept open (`keep_idle`) is asked if it is alive
SETTLE_POLL_S = 0.0002  # how often a thread with slices in flight looks for the next one
INBOX_WAIT_S = 10.0  # longest a receiver waits for room in the inbox before failing the stream
SPARE_BYTES = 256 << 20  # receive buffers kept for reuse (a new one costs its page faults)
MAX_CARRIED = 1024  # unfinished transfers a stream remembers, to cancel them if it fails
CANCEL_GIVE_UP = 3  # failed cancels in a row after which a receiver is taken to be gone
_CLOSE = object()


@dataclass(frozen=True)
class LayerSlice:
    """One layer's KV for consecutive blocks and heads of one transfer: a wire tensor
    [num_blocks, num_heads, block_size, kv_size, head_size] as raw bytes. On the sending side `data`
    is staged (kv_transfer/host_staging.Staged: its bytes may still be on their way from the
    device); on the receiving side a bytearray, or a uint8 tensor on the device (nccl on CUDA),
    and `release()` must be called once it is loaded or dropped (it frees inbox room)."""

    transfer_id: str
    layer: int
    first_block: int
    num_blocks: int
    first_head: int  # global KV head index
    num_heads: int
    data: object  # Staged when sent; bytearray or device tensor when received
    last: bool  # the sender's last slice of this layer for the transfer
    received_at: float = 0.0  # receiver's monotonic clock, when the slice was complete
    transport: str = ""  # receiver side: what carried it
    on_release: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    epoch: int = 0  # its transfer's identity (kv_transfer/integrity.transfer_epoch)
    seq: int = 0  # its place among its sender's slices of the transfer to this rank: 0, 1, ...
    digest: int = 0  # of its bytes (integrity.slice_digest), set by the sending thread
    damage: str = ""  # receiver side: an integrity.Damage its bytes were found with, or ""

    def release(self) -> None:
        if self.on_release is not None:
            self.on_release()


def nbytes(data) -> int:
    """Bytes of a received slice's data (a bytearray, or a tensor)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return len(data)
    return data.numel() * data.element_size()


class Refused(Exception):
    """The receiver refused the handshake; the message names the mismatch."""


class ChannelError(Exception):
    """The channel failed (peer gone, deadline passed); its transfers are cancelled."""


class Channel(Protocol):
    """The sending end of one transport to one decode rank, used from one thread.

    A pipelined channel (nccl) has slices in flight after `send` returns and also has
    `done(wait) -> list[LayerSlice]`: the slices whose bytes went through since the last call,
    in the order sent (`wait`: once all have); their staged buffers may be released then. A
    channel with `keep_idle` true stays open while idle as long as `alive()` (its group costs
    seconds to make again: the next request would pay them); any other is closed after
    IDLE_CLOSE_S without slices."""

    def send(self, piece: LayerSlice) -> None:
        """Move the slice's bytes; returns once its staged buffer may be released (a pipelined
        channel: once it is on its way, see `done`). Raises Refused or ChannelError."""

    def close(self) -> None:
        """Tell the receiver the stream ends on purpose, and free the channel's resources."""


def bind_device(device: torch.device | None) -> None:
    """This thread's CUDA calls go to `device` (call it first in a thread that may touch CUDA:
    otherwise they go to GPU 0, and would make a context there)."""
    if device is not None and device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


class InFlight:
    """What one sending thread has handed its channel: the slices not yet through (a pipelined
    channel's), and the staged buffers to release once their slices are."""

    def __init__(self, channel: Channel, carried: "Carried") -> None:
        self.channel = channel
        self.carried = carried
        self.pipelined = callable(getattr(channel, "done", None))
        self.posted = 0  # slices handed to the channel
        self.settled = 0  # ... that went through
        self.batches: deque[tuple[int, LayerSlice]] = deque()  # (posted by then, staged)

    @property
    def busy(self) -> bool:
        return self.settled < self.posted

    def send(self, out: LayerSlice) -> None:
        self.channel.send(out)
        self.posted += 1
        if not self.pipelined:
            self._settled(out)

    def staged(self, piece: LayerSlice) -> None:
        """`piece`'s buffer is released once what was sent so far has gone through."""
        self.batches.append((self.posted, piece))
        self.collect(wait=False)

    def collect(self, wait: bool) -> None:
        if self.pipelined and self.busy:
            for out in self.channel.done(wait):
                self._settled(out)
        while self.batches and self.batches[0][0] <= self.settled:
            self.batches.popleft()[1].data.release()

    def _settled(self, out: LayerSlice) -> None:
        self.settled += 1
        self.carried.sent(out)

    def release_all(self) -> None:
        """The channel failed: nothing more goes through (an NCCL group holds what its aborted
        operations read until they end, so the memory is safe to lend again)."""
        while self.batches:
            self.batches.popleft()[1].data.release()


OpenChannel = Callable[[Transport, str], Channel]
_GONE = object()  # an idle channel kept open found its receiver gone


class KvSender:
    """Sends layer slices from one background thread per (destination, transport), so the
    forward pass never waits on the network. That thread computes each slice's digest as it
    sends it (`integrity`). It opens its channel (handshake included) on the first slice and
    closes it after IDLE_CLOSE_S without slices (a channel that keeps idle is closed once it is
    no longer alive instead). Slices a pipelined channel has in flight are finished while the
    thread waits for the next. When a channel fails or is refused, every slice still queued or
    in flight on it is released and each transfer it carried is cancelled on the receiver with
    the reason, so the decode worker applies its policy at once rather than at its deadline.
    The next slice opens a new channel.

    `open_channel(kind, destination)` makes the channel; `cancel(destination, transfer_id,
    Cancel)` reaches the receiver's control service (gRPC for every transport).

    What a channel carried is what is in flight on it: a transfer leaves the set once its last
    slice of every one of `num_layers` layers has been sent (0: the layers are not known, and
    only the MAX_CARRIED bound applies), so a long-lived channel's set stays small, and a
    failure cancels only what had not been sent whole, one cancel after another from one
    thread (a transfer whose bytes were still queued when its stream failed is cancelled by
    the receiver, which had begun it, or else waits for its deadline)."""

    def __init__(
        self,
        open_channel: OpenChannel,
        cancel: Callable[[str, str, Cancel], None],
        idle_close_s: float = IDLE_CLOSE_S,
        integrity: bool = True,
        num_layers: int = 0,
        device: torch.device | None = None,
    ) -> None:
        """`device`: where the staged slices are (its threads bind it)."""
        self.open_channel = open_channel
        self.device = device
        self.integrity = integrity
        self.cancel_on_receiver = cancel
        self.idle_close_s = idle_close_s
        self.num_layers = num_layers
        self.queues: dict[tuple[str, str], queue.Queue] = {}
        self.threads: dict[tuple[str, str], threading.Thread] = {}
        self.lock = threading.Lock()

    def send(self, destination: str, kind: Transport, piece: LayerSlice) -> None:
        key = (destination, kind)
        with self.lock:
            pending = self.queues.get(key)
            if pending is None:  # no channel yet, or the last one ended
                pending = self.queues[key] = queue.Queue()
                thread = threading.Thread(
                    target=self._run,
                    args=(key, pending),
                    name=f"kv-send-{kind}-{destination}",
                    daemon=True,
                )
                self.threads[key] = thread
                thread.start()
            pending.put(piece)

    def _run(self, key: tuple[str, str], pending: queue.Queue) -> None:
        destination, kind = key
        carried = Carried(self.num_layers)
        failure = None
        channel = None
        flight = None
        bind_device(self.device)
        log.info("KV channel (%s) to %s opening", kind, destination)
        try:
            channel = self.open_channel(kind, destination)
            flight = InFlight(channel, carried)
            while (piece := self._next(key, pending, flight)) is not _CLOSE and piece is not _GONE:
                carried.begin(piece.transfer_id)
                try:
                    flight.send(self._sealed(piece))
                except BaseException:
                    piece.data.release()
                    raise
                flight.staged(piece)
            if piece is _GONE:
                closing, channel = channel, None
                try:
                    closing.close()
                except Exception as error:  # it is gone: nothing was in flight
                    log.info(
                        "KV channel (%s) to %s: its receiver went away (%s)",
                        kind,
                        destination,
                        error,
                    )
            else:
                flight.collect(wait=True)
                closing, channel = channel, None
                closing.close()  # says what the stream ended with, if it failed
        except Refused as error:
            failure = Cancel(Failure.REFUSED, str(error))
            log.error("KV channel (%s) to %s refused: %s", kind, destination, error)
        except Exception as error:
            failure = Cancel(
                Failure.CANCELLED, f"KV channel ({kind}) to {destination} failed: {error}"
            )
            log.error("%s", failure.reason)
        finally:
            with self.lock:  # later slices for this destination go to a new channel
                if self.queues.get(key) is pending:
                    del self.queues[key]
                if self.threads.get(key) is threading.current_thread():
                    del self.threads[key]
            for transfer_id in _release_queued(pending):
                carried.begin(transfer_id)
            if flight is not None:
                flight.release_all()
            if channel is not None:
                try:
                    channel.close()
                except Exception as error:
                    log.warning("closing KV channel to %s: %s", destination, error)
        if failure is not None:
            self.cancel_all(destination, carried.in_flight(), failure)
        else:
            log.info("KV channel (%s) to %s closed", kind, destination)

    def _sealed(self, piece: LayerSlice) -> LayerSlice:
        return sealed(piece) if self.integrity else piece

    def _next(self, key: tuple[str, str], pending: queue.Queue, flight: InFlight):
        """The next slice (while waiting for it, the slices in flight are finished); _CLOSE
        once the channel has been idle too long, _GONE once a channel kept idle is no longer
        alive."""
        while flight.busy:
            try:
                return pending.get(timeout=SETTLE_POLL_S)
            except queue.Empty:
                flight.collect(wait=False)
        channel = flight.channel
        keep = bool(getattr(channel, "keep_idle", False))
        idle_since = time.monotonic()
        while True:
            left = idle_since + self.idle_close_s - time.monotonic()
            try:
                return pending.get(timeout=LIVENESS_S if keep else max(left, 0.0))
            except queue.Empty:
                with self.lock:
                    if not pending.empty():
                        continue
                    if keep and channel.alive():
                        continue
                    if not keep and time.monotonic() < idle_since + self.idle_close_s:
                        continue
                    del self.queues[key]
                    return _GONE if keep else _CLOSE

    def cancel(self, destination: str, transfer_id: str, cancel: Cancel) -> None:
        """Tell the receiver a transfer will not complete, from a thread of its own (the
        caller may be the forward pass)."""

        def call() -> None:
            try:
                self.cancel_on_receiver(destination, transfer_id, cancel)
            except Exception as error:
                log.warning("could not cancel transfer %s: %s", transfer_id, error)

        threading.Thread(target=call, name=f"kv-cancel-{transfer_id}", daemon=True).start()

    def cancel_all(self, destination: str, transfer_ids: list[str], cancel: Cancel) -> None:
        """Cancel each of `transfer_ids` on the receiver, one after another from one thread of
        their own; after CANCEL_GIVE_UP failures in a row the receiver is taken to be gone
        (its transfers' deadlines still apply)."""
        if not transfer_ids:
            return

        def call() -> None:
            failures = 0
            for done, transfer_id in enumerate(transfer_ids, 1):
                try:
                    self.cancel_on_receiver(destination, transfer_id, cancel)
                    failures = 0
                except Exception as error:
                    failures += 1
                    log.warning("could not cancel transfer %s: %s", transfer_id, error)
                    if failures >= CANCEL_GIVE_UP:
                        log.warning(
                            "%s takes no cancels: %d more transfers left to their deadlines",
                            destination,
                            len(transfer_ids) - done,
                        )
                        return

        threading.Thread(target=call, name=f"kv-cancel-{destination}", daemon=True).start()

    def close(self) -> None:
        with self.lock:
            for pending in self.queues.values():
                pending.put(_CLOSE)
            threads = list(self.threads.values())
        for thread in threads:
            thread.join(timeout=5)


class Carried:
    """The transfers a stream has begun and not finished (one side of one channel), oldest
    first: a transfer is finished once a last slice of each of `num_layers` layers went
    through (0: never, the layers being unknown); at most MAX_CARRIED are kept (a transfer
    its sender gave up, its request aborted, never finishes: the oldest are forgotten)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layers: OrderedDict[str, set[int]] = OrderedDict()  # transfer -> layers ended

    def begin(self, transfer_id: str) -> None:
        if transfer_id not in self.layers:
            self.layers[transfer_id] = set()
            while len(self.layers) > MAX_CARRIED:
                self.layers.popitem(last=False)

    def sent(self, piece) -> None:
        """`piece` (a LayerSlice or a KvChunk of a whole slice) went through."""
        ended = self.layers.get(piece.transfer_id)
        if ended is None or not piece.last or not self.num_layers:
            return
        ended.add(piece.layer)
        if len(ended) >= self.num_layers:
            del self.layers[piece.transfer_id]

    def in_flight(self) -> list[str]:
        return sorted(self.layers)

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self.layers

    def __len__(self) -> int:
        return len(self.layers)


def sealed(piece: LayerSlice) -> LayerSlice:
    """The slice with its digest, computed by the sending thread (on the device for a device
    tensor: one number comes back)."""
    return replace(piece, digest=slice_digest(piece.data.ready()))


def _release_queued(pending: queue.Queue) -> set[str]:
    """Empty a dead channel's queue, releasing staged slices; their transfer ids."""
    transfer_ids = set()
    while True:
        try:
            piece = pending.get_nowait()
        except queue.Empty:
            return transfer_ids
        if piece is not _CLOSE:
            transfer_ids.add(piece.transfer_id)
            piece.data.release()


class Inbox:
    """Slices received and not yet loaded, at most `max_bytes` of them, and cancels. A
    receiver's `put` waits for room (so it stops reading, and the sender feels it); the loader
    `take`s them and releases each once copied into the cache. Receive buffers come from
    `buffer()`, and a released one is kept for the next slice of its size (up to SPARE_BYTES):
    a fresh one costs a page fault per 4 KiB, which halved shared-memory throughput.

    With `verify`, `put` checks each slice's digest against the bytes that landed, on the
    receiving thread (never vLLM's), and marks a mismatch as its `damage`: the KV loader fails
    the slice's transfer instead of loading it."""

    def __init__(
        self,
        max_bytes: int = INBOX_BYTES,
        wait_s: float = INBOX_WAIT_S,
        verify: bool = True,
        max_slice_bytes: int = 0,
    ) -> None:
        """`max_slice_bytes`: the largest slice a sender may announce (its buffer is made
        before its bytes come), compatibility.max_slice_bytes for the engine's longest
        request; 0: the larger of `max_bytes` and INBOX_BYTES. A slice larger than `max_bytes`
        is let in when the inbox is empty."""
        self.max_bytes = max_bytes
        self.max_slice_bytes = max_slice_bytes or max(max_bytes, INBOX_BYTES)
        self.wait_s = wait_s
        self.verify = verify
        self.held = 0
        self.new_buffer: Callable[[int], object] = bytearray  # pinned beside CUDA (host_staging)
        # Takes back a buffer new_buffer made (True), once its slice is released.
        self.free_buffer: Callable[[object], bool] | None = None
        # Told of each slice once it is held (on the receiving thread): decode_workers/arrivals.py
        self.landed: Callable[[LayerSlice], None] | None = None
        self.spare: dict[int, list[bytearray]] = {}
        self.spare_bytes = 0
        self.complete: list[LayerSlice] = []
        self.cancelled: dict[str, Cancel] = {}  # transfer id -> why it will not complete
        self.lock = threading.Condition()

    def put(self, piece: LayerSlice, reserved: bool = False) -> None:
        """Hold `piece` (its release frees the room); ChannelError when no room came in time.
        `reserved`: its room was taken by `reserve` (its buffer was being filled)."""
        size = nbytes(piece.data)
        if self.verify and slice_digest(as_tensor(piece.data)) != piece.digest:
            piece = replace(piece, damage=Damage.DIGEST)
        if not reserved:
            self.reserve(size)
        with self.lock:
            released = threading.Event()

            def release() -> None:
                if not released.is_set():
                    released.set()
                    self._free(size, piece.data)
                    piece.release()  # what the transport lent, if anything

            self.complete.append(replace(piece, on_release=release))
        if self.landed is not None:
            self.landed(piece)

    def reserve(self, size: int) -> None:
        """Take room for `size` bytes (a slice being received: before its buffer is made),
        waiting for it as `put` does; ChannelError when no room came in time. `unreserve`
        gives it back if the slice never comes whole."""
        timeout_s = self.wait_s
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.held and self.held + size > self.max_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ChannelError(
                        f"the decode worker's KV inbox stayed full ({self.held} bytes) for "
                        f"{timeout_s:g} s"
                    )
                self.lock.wait(left)
            self.held += size

    def has_room(self, size: int) -> bool:
        """Whether `reserve(size)` would not wait now."""
        with self.lock:
            return not self.held or self.held + size <= self.max_bytes

    def unreserve(self, size: int) -> None:
        with self.lock:
            self.held -= size
            self.lock.notify_all()

    def buffer(self, size: int):
        """A writable buffer of `size` bytes for a slice being received (contents undefined):
        a bytearray, or pinned memory from `new_buffer` (given back by `free_buffer`)."""
        with self.lock:
            spare = self.spare.get(size)
            if spare:
                self.spare_bytes -= size
                return spare.pop()
        return self.new_buffer(size)

    def _free(self, size: int, data) -> None:
        if self.free_buffer is not None and self.free_buffer(data):
            data = None  # back where it came from (pinned memory's arena)
        with self.lock:
            self.held -= size
            if isinstance(data, bytearray) and self.spare_bytes + size <= SPARE_BYTES:
                self.spare.setdefault(size, []).append(data)
                self.spare_bytes += size
            self.lock.notify_all()

    def cancel(self, transfer_id: str, cancel: Cancel) -> None:
        with self.lock:
            self.cancelled[transfer_id] = cancel

    def take(self) -> tuple[list[LayerSlice], dict[str, Cancel]]:
        with self.lock:
            complete, self.complete = self.complete, []
            cancelled, self.cancelled = self.cancelled, {}
        return complete, cancelled

    def drop_all(self) -> None:
        """The receiver stops: release what nobody will load (lent segments included)."""
        for piece in self.take()[0]:
            piece.release()


@dataclass
class _Partial:
    key: tuple
    buffer: object
    size: int
    filled: int = 0


class SliceAssembler:
    """Puts a slice back together from its chunks (grpc, shm) on one stream and hands whole
    slices to the inbox. It remembers the transfers the stream carried and has not finished:
    when the stream breaks (its sender died), `abandon` cancels them, so the decode worker does
    not wait for the deadline (a transfer that did complete is still loaded: complete wins over
    cancelled).

    What a peer declares is bounded before anything is allocated: a slice is at most the
    inbox's `max_slice_bytes`, its layer and heads exist (`compatibility`, when given), its
    chunks come in order and stay within it, and a stream has one slice being filled at a time
    (a sender sends a slice's chunks one after another), whose room is taken in the inbox
    before its buffer is made. A chunk that breaks any of these fails the stream
    (ChannelError)."""

    def __init__(self, inbox: Inbox, transport: str, compatibility=None) -> None:
        self.inbox = inbox
        self.transport = transport
        self.num_layers = compatibility.num_layers if compatibility is not None else 0
        self.total_heads = compatibility.total_kv_heads if compatibility is not None else 0
        self.partial: _Partial | None = None
        self.carried = Carried(self.num_layers)

    def check(self, chunk, size: int) -> None:
        """ChannelError unless a slice of `size` bytes described by `chunk` may be received."""
        if size > self.inbox.max_slice_bytes:
            raise ChannelError(
                f"a {size}-byte slice (transfer {chunk.transfer_id!r}): more than any request "
                f"of this engine has ({self.inbox.max_slice_bytes} bytes)"
            )
        if self.num_layers and chunk.layer >= self.num_layers:
            raise ChannelError(f"layer {chunk.layer}: the model has {self.num_layers}")
        if self.total_heads and chunk.first_head + chunk.num_heads > self.total_heads:
            raise ChannelError(
                f"heads {chunk.first_head}+{chunk.num_heads}: the model has {self.total_heads}"
            )

    def add(self, chunk, data) -> None:
        """`chunk`: a KvChunk message; `data`: its bytes (a buffer), at chunk.offset."""
        key = (chunk.transfer_id, chunk.layer, chunk.first_block, chunk.first_head)
        partial = self.partial
        if partial is None:
            self.check(chunk, chunk.slice_bytes)
            self.carried.begin(chunk.transfer_id)
            self.inbox.reserve(chunk.slice_bytes)
            try:
                buffer = self.inbox.buffer(chunk.slice_bytes)
            except BaseException:
                self.inbox.unreserve(chunk.slice_bytes)
                raise
            partial = self.partial = _Partial(key, buffer, chunk.slice_bytes)
        elif partial.key != key or partial.size != chunk.slice_bytes:
            raise ChannelError(
                f"a chunk of another slice (transfer {chunk.transfer_id!r}, layer "
                f"{chunk.layer}) before the last one was whole"
            )
        end = chunk.offset + len(data)
        if chunk.offset != partial.filled or end > partial.size:
            raise ChannelError(
                f"bytes {chunk.offset}-{end} of a {partial.size}-byte slice after "
                f"{partial.filled} bytes (chunks in order, within the slice)"
            )
        partial.buffer[chunk.offset : end] = data
        partial.filled = end
        if end == partial.size:
            self.partial = None
            self.deliver(chunk, partial.buffer, reserved=True)

    def deliver(
        self,
        chunk,
        data,
        on_release: Callable[[], None] | None = None,
        reserved: bool = False,
    ) -> None:
        """A whole slice (`data`: its bytes, or a device tensor) to the inbox; `on_release`
        runs once the loader is done with it. `reserved`: its room is taken (by `add`)."""
        if not reserved:
            self.check(chunk, nbytes(data))
        self.carried.begin(chunk.transfer_id)
        self.inbox.put(
            LayerSlice(
                chunk.transfer_id,
                chunk.layer,
                chunk.first_block,
                chunk.num_blocks,
                chunk.first_head,
                chunk.num_heads,
                data,
                chunk.last,
                time.monotonic(),
                self.transport,
                on_release,
                epoch=chunk.epoch,
                seq=chunk.seq,
                digest=chunk.digest,
            ),
            reserved=reserved,
        )
        self.carried.sent(chunk)

    def abandon(self, reason: str) -> None:
        """The stream ended without finishing what it carried: cancel that, give back the
        room of the slice being filled."""
        for transfer_id in self.carried.in_flight():
            self.inbox.cancel(transfer_id, Cancel(Failure.CANCELLED, reason))
        if self.partial is not None:
            self.inbox.unreserve(self.partial.size)
            self.partial = None


def host_id() -> str:
    """Equal for two processes that can share memory through a Unix socket: same host (boot)
    and same network namespace (abstract Unix sockets live in it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: never the same host as anyone (shm is Linux-only)
        return f"{socket.gethostname()}/{os.getpid()}"
    return f"{socket.gethostname()}/{boot}/{netns}"
