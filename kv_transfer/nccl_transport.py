"""KV over a pairwise torch.distributed group: NCCL between CUDA tensors, gloo between CPU ones.

Each sending channel (one prefill rank -> one decode rank) makes its own 2-rank group, outside
torch.distributed's global state (vLLM's own tensor-parallel group is untouched): the sender is
rank 0 and hosts the group's TCP store on a free port of its advertised host; the NcclOpen
message on the PushKv control stream tells the receiver where, and it joins as rank 1. Each
slice's KvChunk (transfer id, layer, blocks, heads, byte count) goes on the control stream, its
bytes as one tensor over the group, in the same order on both sides. The group lives as long as
its channel: made when the channel opens, reused, aborted when the channel closes (its peer
failed, or ended the control stream). An idle nccl channel is kept open (`keep_idle`) as long
as its control stream lives: making a group again costs a rendezvous and a communicator
(0.3-3 s on GPUs), which the first request after a quiet minute would otherwise wait for; it
holds no more than it held while busy.

Per slice, no fixed wait: completion is polled (`work.is_completed()`, yielding, then backing
off to POLL_MAX_S), never torch's `work.wait(timeout)`, which sleeps 1 ms between polls (a
20 us NVLink transfer took 1 ms). A sending channel keeps up to WINDOW slices in flight (NCCL
runs a pair's operations in order on one stream, and the receiver posts its receives in the
descriptors' order), so the next slice's descriptor, digest and post overlap the last one's
bytes and the receiver's handling (scripts/bench_nccl_slices.py measures slices per second per
channel against a fake group).

Fails soft: no operation on a pdserve group outlives its deadline, and none takes the process
down. torch's ProcessGroupNCCL watchdog acts on an operation that failed or overstayed the
group's timeout: it sets a flag every group of the process shares, which vLLM's world group
(process group 0) turns into a process abort minutes later unless TORCH_NCCL_DUMP_ON_TIMEOUT=0
(the GPU worker's environment sets it: pdserve/worker/gpu_environment.py, which says why this
and not another transport), then applies the group's error handling. So:

- pdserve's own deadline aborts the whole group (`ProcessGroupNCCL.abort`) before anything is
  recorded on the operation: the watchdog skips an aborted group's error checks, and its
  aborted kernels end, so it never sees a failure there;
- an error NCCL reports (a dead peer) may reach the watchdog first: pdserve's groups are made
  with CleanUpOnly error handling (that group's communicator is aborted, never the process) and
  no heartbeat monitor of their own, and process group 0 ignores the shared flag.

On a failure the channel raises ChannelError: the sender's KvSender cancels the transfers it
carried, the receiver's stream cancels those it had begun (kv_transfer/transport.py), both keep
serving, and the next slice opens a new group. A full decode inbox fails the receiver's stream,
which aborts both ends, as it fails a grpc or shm stream; the receiver takes a slice's room in
the inbox before it allocates the slice's device memory.

Test T1 of scripts/gpu_check.py (scripts/gpu_t1_pg0_kill.py) proves on one GPU that a group
made as PairGroup makes it, whose operation times out beside a vLLM-like process group 0, leaves
the process alive.

On CUDA the tensor is the gathered wire tensor on the device (no host copy); each side posts
its operations from a stream of its own, and an operation that polled complete has written or
read its buffer (the event after its kernel has passed) before the buffer is released or handed
on. A received tensor was allocated on the receiver's stream: the KV loader holds it (and
anything made from it) until its own side stream has passed an event recorded after the
scatter that reads it (kv_transfer/host_staging.HostToDevice), so the allocator never lends it
to the next receive while a queued scatter still has to read it.
"""

import contextlib
import logging
import math
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import PushStream, handshake, hello, slice_chunk
from kv_transfer.transport import SETTLE_POLL_S, ChannelError, LayerSlice, bind_device

log = logging.getLogger("pdserve.kv")

GROUP_TIMEOUT_S = 30.0  # rendezvous, communicator creation, and any one send or receive
WATCHDOG_FACTOR = 2.0  # torch's own timeout for a group's op, in multiples of pdserve's
POLL_S = 0.02  # how often the rendezvous looks for its peer
SPIN_S = 200e-6  # an operation's first polls only yield the GIL (a small slice is done by then)
POLL_MAX_S = 2e-4  # then the sleeps between polls double up to this
WINDOW = 4  # slices a sending nccl channel has in flight at once
_PREFIX = "pdserve-kv"
_ENDED = object()  # ReadAhead: the stream ended
# Read by ProcessGroupNCCL's constructor, so set only while a pdserve group is made (vLLM's
# own groups keep theirs): on an error or timeout its watchdog aborts that communicator only
# (2 = CleanUpOnly; the default 3 takes the process down), and no heartbeat monitor may kill
# the process for a watchdog stuck in an abort. Put back after to what was there, or torch's
# default: a GPU worker has them set already (pdserve/worker/gpu_environment.NCCL_SEEDS), so
# each change replaces a value in place and never adds or removes a variable while vLLM's
# threads may read the environment.
_NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
_TORCH_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"}
_ENV_LOCK = threading.Lock()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rendezvous(store, rank: int, timeout_s: float, alive: Callable[[], None] = lambda: None):
    """Both ranks check in on the store before any communicator is made: a peer that never
    comes fails here, within `timeout_s`, with nothing of NCCL's to clean up. `alive()` is
    called while waiting and raises to give up early (the sender's control stream ended)."""
    store.set(f"{_PREFIX}/joined/{rank}", "1")
    peer = f"{_PREFIX}/joined/{1 - rank}"
    deadline = time.monotonic() + timeout_s
    while not store.check([peer]):
        alive()
        if time.monotonic() > deadline:
            raise ChannelError(f"the peer did not join the group within {timeout_s:g} s")
        time.sleep(POLL_S)


@contextlib.contextmanager
def _nccl_group_env(timeout_s: float):
    """The environment a pdserve ProcessGroupNCCL is made in (see _NCCL_GROUP_ENV).

    TORCH_NCCL_NONBLOCKING_TIMEOUT bounds a non-blocking communicator's creation and calls; torch
    reads it once per process, so it is set for good (only pdserve's groups are non-blocking;
    a value the user or the worker's start set stands)."""
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(math.ceil(timeout_s)))
    with _ENV_LOCK:
        saved = {name: os.environ.get(name, _TORCH_DEFAULTS[name]) for name in _NCCL_GROUP_ENV}
        os.environ.update(_NCCL_GROUP_ENV)
        try:
            yield
        finally:
            os.environ.update(saved)


def nccl_backend(store, rank: int, size: int, device, timeout_s: float):
    """A ProcessGroupNCCL as pdserve makes its groups (gpu_check's T1 makes a 1-rank one the same
    way): not registered anywhere global, non-blocking, CleanUpOnly and unmonitored
    (_NCCL_GROUP_ENV), torch's timeout WATCHDOG_FACTOR times pdserve's, its communicator made
    now (NCCL would otherwise make it lazily, unbounded, inside the first operation)."""
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    # The watchdog's timeout: past pdserve's own deadline, never before it.
    options._timeout = timedelta(seconds=timeout_s * WATCHDOG_FACTOR)
    options.config.blocking = 0  # non-blocking: creation and calls bounded, abortable
    with _nccl_group_env(timeout_s):
        group = ProcessGroupNCCL(store, rank, size, options)
    try:
        group.eager_connect_single_device(device)
    except BaseException:
        group.abort()
        raise
    return group


def _make_backend(store, backend: str, rank: int, host: str, device, timeout_s: float):
    """The backend over `store`, its communicator made now."""
    if backend == "gloo":  # connects both ranks here, within the timeout (gloo has no watchdog)
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timedelta(seconds=timeout_s)
        return ProcessGroupGloo(store, rank, 2, options)
    return nccl_backend(store, rank, 2, device, timeout_s)


def on_stream(cuda_stream):
    """Operations are posted, and their completion taken, on a channel end's own CUDA stream
    (none on CPU)."""
    if cuda_stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(cuda_stream)


@dataclass
class Posted:
    """An operation posted on a PairGroup, and when pdserve gives up on it."""

    work: object
    what: str
    deadline: float


def _drop(group, device) -> None:
    """Let go of an aborted backend, on a thread of its own: its destructor joins torch's
    watchdog, which may be sleeping after an error (a minute); the GIL is released then, but
    the thread that drops it would wait that long."""
    bind_device(device)
    del group


class PairGroup:
    """A 2-rank group whose every operation is bounded, and which is aborted, never dropped.

    - Creation: the store rendezvous (rendezvous()), then the communicator, made eagerly
      (NCCL: `eager_connect_single_device`, non-blocking, so TORCH_NCCL_NONBLOCKING_TIMEOUT
      bounds it; gloo connects in its constructor, within the deadline).
    - Each send or receive has pdserve's deadline, `timeout_s` from when it is posted
      (`post_send`, `post_recv`; `finish` or `done` end it; `send`, `recv` do both). NCCL: its
      completion is polled (`is_completed()`, no fixed sleep); at the deadline the group is
      aborted first, so torch's watchdog (its own timeout WATCHDOG_FACTOR times longer) never
      finds the operation failed; an error NCCL reports (a dead peer) aborts the group too,
      and if the watchdog finds it first it aborts this communicator only (_NCCL_GROUP_ENV).
      gloo: `work.wait(timeout)` (gloo's P2P work completes only in `wait`; no watchdog).
    - On any failure, and on close, `abort()` aborts the group (ProcessGroupNCCL.abort: its
      watchdog stops, its communicator is aborted, within the group timeout) before it is
      dropped (on a thread of its own: `_drop`). It may be called from another thread (the
      control stream's end) to fail a pending NCCL op at once; an op that completes after it
      still raises (an aborted NCCL communicator's work can look complete). gloo's abort does
      not wake a pending op: there the peer's end closing its sockets does (a dead process, or
      its group aborted and dropped), else the op's deadline.
    """

    def __init__(
        self,
        store,
        backend: str,
        rank: int,
        host: str,
        device: torch.device,
        timeout_s: float = GROUP_TIMEOUT_S,
        alive: Callable[[], None] = lambda: None,
    ) -> None:
        self._start(None, 1 - rank, timeout_s, polls=backend == "nccl", device=device)
        if backend == "nccl" and device.index is None:
            device = self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            rendezvous(store, rank, timeout_s, alive)
            self.group = _make_backend(
                PrefixStore(_PREFIX, store), backend, rank, host, device, timeout_s
            )
        except RuntimeError as error:  # the peer joined the store, not the group, in time
            raise ChannelError(f"{backend} group: {error}") from None

    def _start(self, group, peer: int, timeout_s: float, polls: bool, device=None) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        self.polls = polls  # NCCL: completion polled; gloo: waited
        self.device = device
        self.lock = threading.Lock()
        self.aborted = ""  # why, once aborted
        self.group = group

    @classmethod
    def over(cls, group, peer: int, timeout_s: float, polls: bool = True, device=None):
        """A PairGroup over a backend made elsewhere (gpu_check's T1, tests, benchmarks)."""
        made = cls.__new__(cls)
        made._start(group, peer, timeout_s, polls, device)
        return made

    def send(self, tensor: torch.Tensor) -> None:
        self.finish(self.post_send(tensor))

    def recv(self, tensor: torch.Tensor) -> None:
        self.finish(self.post_recv(tensor))

    def post_send(self, tensor: torch.Tensor) -> Posted:
        return self.post(lambda group: group.send([tensor], self.peer, 0), "KV send")

    def post_recv(self, tensor: torch.Tensor) -> Posted:
        return self.post(lambda group: group.recv([tensor], self.peer, 0), "KV receive")

    def post(self, start: Callable, what: str) -> Posted:
        """Post `start(backend)` (it returns a torch Work), its deadline timeout_s from now."""
        self._check(what)
        deadline = time.monotonic() + self.timeout_s
        try:
            work = start(self.group)
        except RuntimeError as error:
            self._fail(what, error)
        return Posted(work, what, deadline)

    def finish(self, posted: Posted) -> None:
        """Until `posted` is through: ChannelError if it failed, passed its deadline, or the
        group was aborted meanwhile."""
        if not self.polls:
            self._check(posted.what)
            left = max(posted.deadline - time.monotonic(), 1e-3)
            try:
                posted.work.wait(timedelta(seconds=left))
            except RuntimeError as error:  # the peer died, or the deadline passed
                self._fail(posted.what, error)
            self._check(posted.what)
            return
        delay, spin_until = 0.0, time.monotonic() + SPIN_S
        while not self.done(posted):
            time.sleep(delay)
            if time.monotonic() > spin_until:
                delay = min(max(2 * delay, 20e-6), POLL_MAX_S)

    def done(self, posted: Posted) -> bool:
        """Whether `posted` is through, without waiting (NCCL's: gloo's completes only in
        `finish`); ChannelError as `finish`. At its deadline the group is aborted before
        anything is recorded on the operation (torch's watchdog acts on what is)."""
        self._check(posted.what)
        if not self.polls:
            return False
        try:
            complete = posted.work.is_completed()  # NCCL: an event query, and NCCL's errors
            if complete:
                posted.work.wait()  # complete: no wait; raises if it failed (and lets go of
                # the tensors torch kept for the allocator's sake)
        except RuntimeError as error:
            self._fail(posted.what, error)
        if complete:
            self._check(posted.what)  # an aborted communicator's work can look complete
            return True
        if time.monotonic() > posted.deadline:
            self.abort(f"{posted.what} timed out")
            raise ChannelError(f"{posted.what} failed: not through within {self.timeout_s:g} s")
        return False

    def _check(self, what: str) -> None:
        if self.aborted:
            raise ChannelError(f"{what}: the group was aborted ({self.aborted})")

    def _fail(self, what: str, error: Exception):
        self.abort(f"{what} failed")
        raise ChannelError(f"{what} failed: {error}") from None

    def abort(self, reason: str = "closed") -> None:
        """Abort the communicator (once; from any thread); later operations raise."""
        with self.lock:
            group = None if self.aborted else self.group
            self.aborted = self.aborted or reason
        if group is None:
            return
        try:
            group.abort()
        except RuntimeError as error:  # bounded by the group timeout, and nothing to undo
            log.warning("aborting a KV group: %s", error)

    def close(self) -> None:
        """Abort, and let go of the backend (gloo closes its sockets then: a peer's pending
        operation fails at once), on a thread of its own. From the thread that runs the
        group's operations."""
        self.abort()
        group, self.group = self.group, None
        if group is not None:
            threading.Thread(
                target=_drop, args=(group, self.device), name="kv-group-drop", daemon=True
            ).start()
            del group


class NcclChannel:
    """The sending end (rank 0): pipelined (up to `window` slices in flight, see `done`; one
    on gloo, whose operations complete only when waited), and kept open while idle as long as
    its control stream lives (`keep_idle`, `alive`)."""

    keep_idle = True

    def __init__(
        self,
        destination: str,
        compatibility: Compatibility,
        host: str,
        device: torch.device,
        timeout_s: float = GROUP_TIMEOUT_S,
        window: int = WINDOW,
    ) -> None:
        handshake(destination, compatibility)  # a refusal before any group exists
        self.device = device
        self.timeout_s = timeout_s
        backend = backend_for(device)
        self.store = TCPStore(
            host,
            0,
            world_size=2,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.stream = PushStream(
            destination,
            [
                hello(compatibility),
                wire.KvMessage(
                    nccl_open=wire.NcclOpen(
                        host=host, port=self.store.port, backend=backend, timeout_s=timeout_s
                    )
                ),
            ],
        )
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.group = PairGroup(
                self.store, backend, 0, host, device, timeout_s, self.stream.check
            )
        except Exception:  # the receiver did not join in time, or refused the stream
            self.stream.call.cancel()
            self.stream.channel.close()
            raise
        group = self.group  # the receiver ending the stream fails a send waiting on it at once
        self.stream.call.add_done_callback(lambda _: group.abort("the control stream ended"))
        self._start(window)

    def _start(self, window: int) -> None:
        self.cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.window = max(1, window) if self.group.polls else 1
        self.in_flight: deque[tuple[LayerSlice, Posted | None]] = deque()  # oldest first
        self.through: list[LayerSlice] = []  # through, not yet given back by `done`

    @classmethod
    def over(cls, stream, group: PairGroup, device: torch.device, window: int = WINDOW):
        """A channel over a control stream (`put(message)`, `close()`, `call.done()`) and a
        PairGroup made elsewhere (benchmarks and tests with a fake group)."""
        made = cls.__new__(cls)
        made.stream, made.group, made.device = stream, group, device
        made.timeout_s, made.store = group.timeout_s, None
        made._start(window)
        return made

    def _on_stream(self):
        return on_stream(self.cuda_stream)

    def send(self, piece: LayerSlice) -> None:
        """Post the slice (its descriptor first: the receiver posts its receive on it); once
        `window` are in flight, wait for the oldest. The slice is through once `done` gives it
        back (with a window of 1, when this returns)."""
        tensor = piece.data.ready()
        self.stream.put(wire.KvMessage(chunk=slice_chunk(piece, 0, tensor.numel())))
        posted = None
        if tensor.numel():
            with self._on_stream():
                posted = self.group.post_send(tensor)
        self.in_flight.append((piece, posted))
        while len(self.in_flight) >= self.window:
            self._settle(wait=True)
        self._settle(wait=False)

    def done(self, wait: bool) -> list[LayerSlice]:
        """The slices through since the last call, in the order sent (`wait`: all of them)."""
        while self.in_flight and self._settle(wait):
            pass
        through, self.through = self.through, []
        return through

    def _settle(self, wait: bool) -> bool:
        """The oldest slice in flight, if it is through (`wait`: once it is)."""
        if not self.in_flight:
            return False
        piece, posted = self.in_flight[0]
        if posted is not None:
            with self._on_stream():
                if wait:
                    self.group.finish(posted)
                elif not self.group.done(posted):
                    return False
        self.in_flight.popleft()
        self.through.append(piece)
        return True

    def alive(self) -> bool:
        """Whether the channel can still carry slices: its group is not aborted and its control
        stream has not ended."""
        return not self.group.aborted and not self.stream.call.done()

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.in_flight.clear()  # a posted operation keeps its group's transport alive
            self.group.close()
            self.store = None


def group_timeout(asked_s: float) -> float:
    """The receiver's group timeout for a sender's `timeout_s`: within [1, GROUP_TIMEOUT_S]
    (a handler thread waits that long at most), GROUP_TIMEOUT_S when unset or not a number."""
    if not math.isfinite(asked_s) or asked_s <= 0:
        return GROUP_TIMEOUT_S
    return min(max(asked_s, 1.0), GROUP_TIMEOUT_S)


class ReadAhead:
    """A stream's messages, read by a thread of their own into a small queue, so the receiving
    thread can post the next slice's receive while the last one's bytes are still on their way
    or being checked. At most AHEAD messages wait (a sender that sends faster is held by
    gRPC's flow control, as before)."""

    AHEAD = 2 * WINDOW + 2

    def __init__(self, messages) -> None:
        self.queue: queue.Queue = queue.Queue(maxsize=self.AHEAD)
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._read, args=(messages,), name="kv-nccl-read", daemon=True
        )
        self.thread.start()

    def _read(self, messages) -> None:
        last = _ENDED
        try:
            for message in messages:
                if not self._put(message):
                    return
        except BaseException as error:  # the stream failed: the receiving thread raises it
            last = error if isinstance(error, Exception) else ChannelError(repr(error))
        self._put(last)  # always: the receiving thread may be waiting for a message

    def _put(self, item) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self, wait: bool):
        """The next message, _ENDED once the stream ended; None when none came within
        SETTLE_POLL_S (`wait` false: receives are pending); raises what the stream failed with."""
        try:
            item = self.queue.get(timeout=None if wait else SETTLE_POLL_S)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        self.stopped.set()


def _delivered(pending: deque) -> tuple[object, object]:
    """The oldest pending slice's (chunk, data), its posted operation let go of (no local of
    the caller's may keep an operation: it keeps its group's transport alive)."""
    chunk, _, data = pending.popleft()
    return chunk, data


class NcclReceiving:
    """The receiving end (rank 1) of one channel, on the receiver's control stream thread:
    `serve` receives every slice the stream describes, up to `window` receives posted at once
    (one on gloo)."""

    def __init__(self, request: wire.NcclOpen, host: str, device: torch.device) -> None:
        if request.backend != backend_for(device):
            raise ChannelError(
                f"the sender uses {request.backend}, this rank's KV is on {device.type}"
            )
        if not request.host or not 0 < request.port < 65536:
            raise ChannelError(f"no group store at {request.host!r}:{request.port}")
        self.device = device
        self.timeout_s = group_timeout(request.timeout_s)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            store = TCPStore(
                request.host, request.port, world_size=2, is_master=False, timeout=timeout
            )
        except RuntimeError as error:
            raise ChannelError(f"the sender's group store: {error}") from None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.group = PairGroup(store, request.backend, 1, host, device, self.timeout_s)
        self.store = store
        self._start(WINDOW)

    def _start(self, window: int) -> None:
        self.cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.window = max(1, window) if self.group.polls else 1

    @classmethod
    def over(cls, group: PairGroup, device: torch.device, window: int = WINDOW):
        """A receiving end over a PairGroup made elsewhere (benchmarks, tests)."""
        made = cls.__new__(cls)
        made.group, made.device, made.timeout_s, made.store = group, device, group.timeout_s, None
        made._start(window)
        return made

    def _on_stream(self):
        return on_stream(self.cuda_stream)

    def serve(
        self,
        messages,
        admit: Callable[[object], None],
        reserve: Callable[[int], None],
        unreserve: Callable[[int], None],
        buffer: Callable[[int], object],
        deliver: Callable[[object, object], None],
        has_room: Callable[[int], bool] = lambda size: True,
    ) -> bool:
        """Receive the slices `messages` (the rest of the stream) describe, in order: for each
        descriptor, `admit(chunk)` (raises to refuse it), `reserve(length)` (its room in the
        inbox, before its memory is made), its receive posted; once its bytes are in,
        `deliver(chunk, data)` (the room is the slice's then). Returns True at the sender's
        bye (everything received), False when the stream ended without one; raises
        ChannelError (or what the stream failed with). Room taken for a slice not delivered
        is given back. When `has_room(length)` says the reservation would wait, the slices
        pending are received and delivered first (the loader can free room only once it has
        them)."""
        ahead = ReadAhead(messages)
        pending: deque[tuple[object, Posted | None, object]] = deque()
        try:
            while True:
                while pending and self._through(pending[0][1], len(pending) >= self.window):
                    deliver(*_delivered(pending))
                message = ahead.next(wait=not pending)
                if message is None:
                    continue
                if message is _ENDED:
                    return False
                body = message.WhichOneof("body")
                if body == "chunk":
                    chunk = message.chunk
                    if chunk.length != chunk.slice_bytes:
                        raise ChannelError(
                            f"an nccl slice of {chunk.length} bytes said {chunk.slice_bytes}"
                        )
                    admit(chunk)  # before anything is allocated
                    if pending and not has_room(chunk.length):
                        while pending:  # their sends are posted: their bytes come
                            self._through(pending[0][1], True)
                            deliver(*_delivered(pending))
                    reserve(chunk.length)
                    try:  # (no local keeps the operation: see below)
                        pending.append((chunk, *self._post(chunk.length, buffer)))
                    except BaseException:
                        unreserve(chunk.length)
                        raise
                elif body == "bye":
                    while pending:
                        self._through(pending[0][1], True)
                        deliver(*_delivered(pending))
                    return True
                elif body == "nccl_open":
                    raise ChannelError("a second nccl_open on one stream")
        except BaseException as error:
            # A posted operation keeps its group's transport alive (gloo: the sockets whose
            # closing fails the sender's pending send at once), and a failure is kept (logged,
            # with its traceback's frames): no frame of it may still hold one.
            traceback.clear_frames(error.__traceback__)
            raise
        finally:
            ahead.stop()
            while pending:
                unreserve(pending.popleft()[0].length)

    def _post(self, length: int, buffer: Callable[[int], object]):
        """Post the receive of a `length`-byte slice: (what was posted or None, its memory: a
        buffer from `buffer(length)` on CPU, a uint8 tensor on the device on CUDA)."""
        if self.cuda_stream is None:
            data = buffer(length)
            target = torch.frombuffer(data, dtype=torch.uint8) if length else None
        else:
            with self._on_stream():
                data = target = torch.empty(length, dtype=torch.uint8, device=self.device)
        if not length:
            return None, data
        with self._on_stream():
            return self.group.post_recv(target), data

    def _through(self, posted: Posted | None, wait: bool) -> bool:
        """Whether a posted receive's bytes are in (`wait`: once they are); a device tensor is
        then complete for any stream to read (its kernel's end event has passed)."""
        if posted is None:
            return True
        with self._on_stream():
            if wait:
                self.group.finish(posted)
                return True
            return self.group.done(posted)

    def receive(self, length: int, buffer: Callable[[int], bytearray]):
        """One slice's bytes, posted and waited for (tests)."""
        posted, data = self._post(length, buffer)
        self._through(posted, True)
        return data

    def abort(self, reason: str = "closed") -> None:
        """Fail a pending receive at once (the sender's stream ended; any thread)."""
        self.group.abort(reason)

    def close(self) -> None:
        self.group.close()
        self.store = None
