"""The gRPC KV sender against a real receiver on loopback: a refused handshake cancels every
transfer the stream carried, sending again right after a stream ended starts a new one, and a
staged slice's host buffer is released even when its stream stops reading midway."""

import time
from dataclasses import replace

import torch

from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import KvReceiver, KvSender, LayerSlice, chunks_of
from kv_transfer.host_staging import Staged
from kv_transfer.kv_layout import WIRE_LAYOUT

CONSUMER = Compatibility("m", "float32", 16, 2, 2, 4, WIRE_LAYOUT, "0.32.0")
DEADLINE_S = 10.0


class FakeStagedBuffer(Staged):
    """A CPU `Staged` that counts its releases (stands in for a pinned-pool buffer)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(torch.zeros(nbytes, dtype=torch.uint8), nbytes)
        self.releases = 0
        self.on_release = self._count

    def _count(self, tensor) -> None:
        self.releases += 1


def piece(transfer_id: str, nbytes: int = 64, data=None) -> LayerSlice:
    return LayerSlice(transfer_id, 0, 0, 1, 0, 2, data or FakeStagedBuffer(nbytes), True)


def cancels_within(receiver: KvReceiver, transfer_ids: set[str]) -> dict[str, str]:
    seen: dict[str, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and set(seen) < transfer_ids:
        seen.update(receiver.take()[1])
        time.sleep(0.05)
    return seen


def test_a_refused_stream_cancels_its_transfers_and_a_later_send_opens_a_new_one():
    receiver = KvReceiver(CONSUMER)
    port = receiver.start("127.0.0.1", 0)
    sender = KvSender(replace(CONSUMER, dtype="bfloat16"))
    try:
        first = piece("t-1")
        sender.send(f"127.0.0.1:{port}", first)
        sender.send(f"127.0.0.1:{port}", piece("t-2"))  # while the first stream may be ending
        seen = cancels_within(receiver, {"t-1", "t-2"})
        assert set(seen) == {"t-1", "t-2"}
        assert all(
            "dtype: producer 'bfloat16' != consumer 'float32'" in why for why in seen.values()
        )
        sender.send(f"127.0.0.1:{port}", piece("t-3"))  # after it ended: a new stream
        assert set(cancels_within(receiver, {"t-3"})) == {"t-3"}
        assert first.data.releases == 1
    finally:
        sender.close()
        receiver.stop()


def test_an_accepted_slice_arrives_and_its_buffer_is_released_once():
    receiver = KvReceiver(CONSUMER)
    port = receiver.start("127.0.0.1", 0)
    sender = KvSender(CONSUMER)
    sent = piece("t-1", nbytes=3 << 20)
    try:
        sender.send(f"127.0.0.1:{port}", sent)
        deadline = time.monotonic() + DEADLINE_S
        arrived = []
        while time.monotonic() < deadline and not arrived:
            arrived = receiver.take()[0]
            time.sleep(0.05)
        assert [(p.transfer_id, len(p.data)) for p in arrived] == [("t-1", 3 << 20)]
    finally:
        sender.close()
        receiver.stop()
    assert sent.data.releases == 1


def test_a_staged_slice_is_released_when_its_stream_stops_reading_midway():
    staged = FakeStagedBuffer(3 << 20)  # three chunks of 1 MiB
    chunks = chunks_of(piece("t-1", data=staged))
    next(chunks)
    assert staged.releases == 0
    chunks.close()  # what gRPC's reading thread does when the call ends
    assert staged.releases == 1
