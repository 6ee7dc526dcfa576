"""The two ends of a KV transfer as the transport tests drive them, shared by every test file
that sends to a real KvReceiver: the consumer both ends agree on, the slices a sender sends,
draining what a receiver took in, and a peer that runs as another user."""

import os
import socket
import struct
import time

import torch

from kv_transfer.compatibility import Compatibility
from kv_transfer.host_staging import Staged
from kv_transfer.kv_layout import WIRE_LAYOUT
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.transport import LayerSlice

CONSUMER = Compatibility("m", "float32", 16, 2, 2, 4, WIRE_LAYOUT, "0.32.0", 32, "none")
DEADLINE_S = 15.0
OTHER_UID = os.getuid() + 1


class CountedStaged(Staged):
    """A CPU `Staged` that counts its releases (stands in for a send-buffer allocation)."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__(data, data.numel())
        self.releases = 0
        self.on_release = self._count

    def _count(self, tensor) -> None:
        self.releases += 1


def piece(transfer_id: str, nbytes: int = 64, layer: int = 0, last: bool = True) -> LayerSlice:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    return LayerSlice(transfer_id, layer, 0, 1, 0, 2, CountedStaged(data), last)


def take_until(receiver: KvReceiver, slices: int = 0, cancels: set[str] = frozenset()):
    """What `receiver` took in, (slices, {transfer id: why cancelled}), taken until it holds at
    least `slices` slices and every transfer of `cancels` cancelled, or DEADLINE_S passed (then
    the caller's assertions on what came say what is missing)."""
    got, cancelled = [], {}
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and (len(got) < slices or not set(cancels) <= set(cancelled)):
        more, why = receiver.take()
        got += more
        cancelled.update(why)
        time.sleep(0.02)
    return got, cancelled


def another_users_peer(monkeypatch) -> None:
    """Every SO_PEERCRED in this process says the peer runs as another user (OTHER_UID)."""
    real = socket.socket.getsockopt

    def getsockopt(sock, level, option, *size):
        if (level, option) == (socket.SOL_SOCKET, socket.SO_PEERCRED):
            return struct.pack("3i", 1, OTHER_UID, OTHER_UID)
        return real(sock, level, option, *size)

    monkeypatch.setattr(socket.socket, "getsockopt", getsockopt)
