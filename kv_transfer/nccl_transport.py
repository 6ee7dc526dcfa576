"""KV over a pairwise torch.distributed group: NCCL between CUDA tensors, gloo between CPU ones.

Each sending channel (one prefill rank -> one decode rank) makes its own 2-rank group, outside
torch.distributed's global state (vLLM's own tensor-parallel group is untouched): the sender is
rank 0 and hosts the group's TCP store on a free port of its advertised host; the NcclOpen
message on the PushKv control stream tells the receiver where, and it joins as rank 1. Each
slice's KvChunk (transfer id, layer, blocks, heads, byte count) goes on the control stream, its
bytes as one tensor over the group, in the same order on both sides. The group lives as long as
its channel: made when the channel opens, reused, aborted when the channel closes (idle, or its
peer failed).

Fails soft: no operation on a pdserve group outlives its deadline, and none reaches torch's
watchdog, which by default takes the whole process down (a healthy vLLM worker with it) when an
NCCL op overstays the group's timeout. See PairGroup. On a failure the channel raises
ChannelError: the sender's KvSender cancels the transfers it carried, the receiver's stream
cancels those it had begun (kv_transfer/transport.py), both keep serving, and the next slice
opens a new group. A full decode inbox fails the receiver's stream, which aborts both ends, as
it fails a grpc or shm stream.

On CUDA the tensor is the gathered wire tensor on the device (no host copy); each side works on
a stream of its own and synchronises it before the buffer is released or handed on. A received
tensor was allocated on the receiver's stream: the KV loader holds it (and anything made from
it) until its own side stream has passed an event recorded after the scatter that reads it
(kv_transfer/host_staging.HostToDevice), so the allocator never lends it to the next receive
while a queued scatter still has to read it.
"""

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import PushStream, handshake, hello, slice_chunk
from kv_transfer.transport import ChannelError, LayerSlice

log = logging.getLogger("pdserve.kv")

GROUP_TIMEOUT_S = 30.0  # rendezvous, communicator creation, and any one send or receive
WATCHDOG_FACTOR = 2.0  # torch's own timeout for a group's op, in multiples of pdserve's
POLL_S = 0.02  # how often the rendezvous looks for its peer
_PREFIX = "pdserve-kv"
# Read by ProcessGroupNCCL's constructor, so set only while a pdserve group is made (vLLM's
# own groups keep theirs): on an error or timeout its watchdog aborts that communicator only
# (2 = CleanUpOnly; the default 3 takes the process down), and no heartbeat monitor may kill
# the process for a watchdog stuck in an abort.
_NCCL_GROUP_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"}
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
    a value the user set stands)."""
    os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(math.ceil(timeout_s)))
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in _NCCL_GROUP_ENV}
        os.environ.update(_NCCL_GROUP_ENV)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value


def _make_backend(store, backend: str, rank: int, host: str, device, timeout_s: float):
    """The backend over `store`, not registered anywhere global, its communicator made now
    (NCCL would otherwise make it lazily, unbounded, inside the first send)."""
    if backend == "gloo":  # connects both ranks here, within the timeout (gloo has no watchdog)
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timedelta(seconds=timeout_s)
        return ProcessGroupGloo(store, rank, 2, options)
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    # The watchdog's timeout: past pdserve's own deadline, never before it.
    options._timeout = timedelta(seconds=timeout_s * WATCHDOG_FACTOR)
    options.config.blocking = 0  # non-blocking: creation and calls bounded, abortable
    with _nccl_group_env(timeout_s):
        group = ProcessGroupNCCL(store, rank, 2, options)
    try:
        group.eager_connect_single_device(device)
    except BaseException:
        group.abort()
        raise
    return group


class PairGroup:
    """A 2-rank group whose every operation is bounded, and which is aborted, never dropped.

    - Creation: the store rendezvous (rendezvous()), then the communicator, made eagerly
      (NCCL: `eager_connect_single_device`, non-blocking, so TORCH_NCCL_NONBLOCKING_TIMEOUT
      bounds it; gloo connects in its constructor, within the deadline).
    - Each send or receive is waited with pdserve's deadline (`work.wait(timeout)`: a CPU wait
      on NCCL too, which aborts the communicator when it expires); torch's watchdog timeout is
      WATCHDOG_FACTOR times longer, so the watchdog never sees a pdserve op time out; an error
      the watchdog finds first (a dead peer) aborts the communicator only (_NCCL_GROUP_ENV).
    - On any failure, and on close, `abort()` aborts the group (ProcessGroupNCCL.abort: its
      watchdog stops, its communicator is aborted, within the group timeout) before it is
      dropped. It may be called from another thread (the control stream's end) to fail a
      pending NCCL op at once; an op that returns after it still raises (an aborted NCCL
      communicator's work can look complete). gloo's abort does not wake a pending op: there
      the peer's end closing its sockets does (a dead process, or its group aborted and
      dropped), else the op's deadline.
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
        self.peer = 1 - rank
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.aborted = ""  # why, once aborted
        self.group = None
        if backend == "nccl" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        try:
            rendezvous(store, rank, timeout_s, alive)
            self.group = _make_backend(
                PrefixStore(_PREFIX, store), backend, rank, host, device, timeout_s
            )
        except RuntimeError as error:  # the peer joined the store, not the group, in time
            raise ChannelError(f"{backend} group: {error}") from None

    def send(self, tensor: torch.Tensor) -> None:
        self._run(lambda group: group.send([tensor], self.peer, 0), "KV send")

    def recv(self, tensor: torch.Tensor) -> None:
        self._run(lambda group: group.recv([tensor], self.peer, 0), "KV receive")

    def _run(self, start, what: str) -> None:
        if self.aborted:
            raise ChannelError(f"{what}: the group was aborted ({self.aborted})")
        try:
            start(self.group).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as error:  # the peer died, or the deadline passed
            self.abort(f"{what} failed")
            raise ChannelError(f"{what} failed: {error}") from None
        if self.aborted:
            raise ChannelError(f"{what}: the group was aborted ({self.aborted})")

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
        operation fails at once). From the thread that runs the group's operations."""
        self.abort()
        self.group = None


class NcclChannel:
    """The sending end (rank 0)."""

    def __init__(
        self,
        destination: str,
        compatibility: Compatibility,
        host: str,
        device: torch.device,
        timeout_s: float = GROUP_TIMEOUT_S,
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
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def send(self, piece: LayerSlice) -> None:
        tensor = piece.data.ready()
        self.stream.put(wire.KvMessage(chunk=slice_chunk(piece, 0, tensor.numel())))
        if not tensor.numel():
            return
        if self.cuda_stream is None:
            self.group.send(tensor)
            return
        with torch.cuda.stream(self.cuda_stream):
            self.group.send(tensor)
        self.cuda_stream.synchronize()  # the buffer may be reused once this returns

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.group.close()
            self.store = None


def group_timeout(asked_s: float) -> float:
    """The receiver's group timeout for a sender's `timeout_s`: within [1, GROUP_TIMEOUT_S]
    (a handler thread waits that long at most), GROUP_TIMEOUT_S when unset or not a number."""
    if not math.isfinite(asked_s) or asked_s <= 0:
        return GROUP_TIMEOUT_S
    return min(max(asked_s, 1.0), GROUP_TIMEOUT_S)


class NcclReceiving:
    """The receiving end (rank 1) of one channel, on the receiver's control stream thread."""

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
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def receive(self, length: int, buffer: Callable[[int], bytearray]):
        """The next slice's bytes: a bytearray from `buffer(length)` on CPU, a uint8 tensor on
        the device on CUDA."""
        if self.cuda_stream is None:
            data = buffer(length)
            if length:
                self.group.recv(torch.frombuffer(data, dtype=torch.uint8))
            return data
        with torch.cuda.stream(self.cuda_stream):
            tensor = torch.empty(length, dtype=torch.uint8, device=self.device)
            if length:
                self.group.recv(tensor)
        self.cuda_stream.synchronize()  # complete before any other stream reads it
        return tensor

    def abort(self, reason: str = "closed") -> None:
        """Fail a pending receive at once (the sender's stream ended; any thread)."""
        self.group.abort(reason)

    def close(self) -> None:
        self.group.close()
        self.store = None
