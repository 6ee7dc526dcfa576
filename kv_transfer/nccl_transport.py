"""KV over a pairwise torch.distributed group: NCCL between CUDA tensors, gloo between CPU ones.

Each sending channel (one prefill rank -> one decode rank) makes its own 2-rank group, outside
torch.distributed's global state (vLLM's own tensor-parallel group is untouched): the sender is
rank 0 and hosts the group's TCP store on a free port of its advertised host; the NcclOpen
message on the PushKv control stream tells the receiver where, and it joins as rank 1. Each
slice's KvChunk (transfer id, layer, blocks, heads, byte count) goes on the control stream, its
bytes as one tensor over the group, in the same order on both sides. The group lives as long as
its channel: made on the first slice, reused, torn down when the channel closes (idle, or its
peer failed).

On CUDA the tensor is the gathered wire tensor on the device (no host copy); each side works on
a stream of its own and synchronises it before the buffer is released or handed on. A received
tensor was allocated on the receiver's stream: the KV loader holds it (and anything made from
it) until its own side stream has passed an event recorded after the scatter that reads it
(kv_transfer/host_staging.HostToDevice), so the allocator never lends it to the next receive
while a queued scatter still has to read it.
"""

from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.distributed_c10d import ProcessGroupGloo

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import PushStream, handshake, hello, slice_chunk
from kv_transfer.transport import ChannelError, LayerSlice

GROUP_TIMEOUT_S = 30.0  # rendezvous, and any one send or receive
_PREFIX = "pdserve-kv"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def pair_group(store, backend: str, rank: int, host: str, timeout_s: float):
    """A 2-rank process group over `store`, not registered anywhere global."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = PrefixStore(_PREFIX, store)
    if backend == "gloo":
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = timeout
        return ProcessGroupGloo(prefixed, rank, 2, options)
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(prefixed, rank, 2, options)


def _wait(work, what: str, timeout_s: float) -> None:
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:  # the peer died, or the deadline passed
        raise ChannelError(f"{what} failed: {error}") from None


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
            self.group = pair_group(self.store, backend, 0, host, timeout_s)
        except RuntimeError as error:  # the receiver did not join in time
            self.stream.call.cancel()
            self.stream.channel.close()
            raise ChannelError(f"{backend} group with {destination}: {error}") from None
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def send(self, piece: LayerSlice) -> None:
        tensor = piece.data.ready()
        self.stream.put(wire.KvMessage(chunk=slice_chunk(piece, 0, tensor.numel())))
        if not tensor.numel():
            return
        if self.cuda_stream is None:
            _wait(self.group.send([tensor], 1, 0), "KV send", self.timeout_s)
            return
        with torch.cuda.stream(self.cuda_stream):
            _wait(self.group.send([tensor], 1, 0), "KV send", self.timeout_s)
        self.cuda_stream.synchronize()  # the buffer may be reused once this returns

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.group = None
            self.store = None


class NcclReceiving:
    """The receiving end (rank 1) of one channel, on the receiver's control stream thread."""

    def __init__(self, request: wire.NcclOpen, host: str, device: torch.device) -> None:
        if request.backend != backend_for(device):
            raise ChannelError(
                f"the sender uses {request.backend}, this rank's KV is on {device.type}"
            )
        self.device = device
        self.timeout_s = request.timeout_s or GROUP_TIMEOUT_S
        timeout = timedelta(seconds=self.timeout_s)
        store = TCPStore(request.host, request.port, world_size=2, is_master=False, timeout=timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.group = pair_group(store, request.backend, 1, host, self.timeout_s)
        self.store = store
        self.cuda_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def receive(self, length: int, buffer: Callable[[int], bytearray]):
        """The next slice's bytes: a bytearray from `buffer(length)` on CPU, a uint8 tensor on
        the device on CUDA."""
        if self.cuda_stream is None:
            data = buffer(length)
            if length:
                tensor = torch.frombuffer(data, dtype=torch.uint8)
                _wait(self.group.recv([tensor], 0, 0), "KV receive", self.timeout_s)
            return data
        with torch.cuda.stream(self.cuda_stream):
            tensor = torch.empty(length, dtype=torch.uint8, device=self.device)
            if length:
                _wait(self.group.recv([tensor], 0, 0), "KV receive", self.timeout_s)
        self.cuda_stream.synchronize()  # complete before any other stream reads it
        return tensor

    def close(self) -> None:
        self.group = None
        self.store = None
