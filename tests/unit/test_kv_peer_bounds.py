"""What a KV sender declares is bounded before the receiver allocates for it (security review
2026-12, M3): slice sizes, chunk offsets, layers and heads, one slice being filled per stream
and charged to the inbox, the nccl rendezvous's timeout; and a stream that fails with any
exception cancels the transfers it carried."""

import contextlib
import math
import time

import pytest

from kv_transfer.compatibility import max_slice_bytes
from kv_transfer.grpc_transport import GrpcChannel
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.nccl_transport import GROUP_TIMEOUT_S, group_timeout
from kv_transfer.shm_transport import ShmChannel
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import ChannelError, Inbox, SliceAssembler, sealed
from tests.unit.kv_endpoints import CONSUMER, piece, take_until


class Chunk:
    """A KvChunk's fields, as the receiver reads them."""

    def __init__(self, transfer_id="t-1", layer=0, offset=0, slice_bytes=1024, **more) -> None:
        self.transfer_id, self.layer, self.offset, self.slice_bytes = (
            transfer_id,
            layer,
            offset,
            slice_bytes,
        )
        self.first_block, self.num_blocks, self.first_head, self.num_heads = 0, 1, 0, 2
        self.last, self.epoch, self.seq, self.digest = False, 0, 0, 0
        for name, value in more.items():
            setattr(self, name, value)


@pytest.fixture
def inbox():
    allocated: list[int] = []
    box = Inbox(max_bytes=1 << 20, wait_s=0.2, verify=False)
    box.new_buffer = lambda size: allocated.append(size) or bytearray(size)
    box.allocated = allocated
    return box


def test_a_slice_larger_than_any_request_is_refused_before_anything_is_allocated(inbox):
    assembler = SliceAssembler(inbox, "grpc", CONSUMER)
    with pytest.raises(ChannelError, match="byte slice"):
        assembler.add(Chunk(slice_bytes=2**40), b"x")
    assert inbox.allocated == [] and inbox.held == 0


def test_the_largest_slice_is_one_layer_of_every_head_of_the_longest_request():
    # CONSUMER: blocks of 16 tokens, 2 KV heads, 32 bytes per head-token
    assert max_slice_bytes(CONSUMER, 100) == math.ceil(100 / 16) * 16 * 2 * 32
    receiver = KvReceiver(CONSUMER, max_slice_bytes=max_slice_bytes(CONSUMER, 100))
    assert receiver.inbox.max_slice_bytes == 7 * 16 * 2 * 32


def test_a_layer_or_heads_the_model_has_not_are_refused(inbox):
    with pytest.raises(ChannelError, match="layer 2"):
        SliceAssembler(inbox, "grpc", CONSUMER).add(Chunk(layer=2), b"x")
    with pytest.raises(ChannelError, match="heads 1\\+2"):
        SliceAssembler(inbox, "grpc", CONSUMER).add(Chunk(first_head=1), b"x")
    assert inbox.allocated == [] and inbox.held == 0


@pytest.mark.parametrize("offset", [1, 1020])
def test_chunks_out_of_order_or_past_the_slice_end_are_refused(inbox, offset):
    assembler = SliceAssembler(inbox, "grpc", CONSUMER)
    assembler.add(Chunk(), bytes(8))
    with pytest.raises(ChannelError, match="bytes"):
        assembler.add(Chunk(offset=8 + offset), bytes(8))
    assembler.abandon("stream failed")
    assert inbox.held == 0  # the partial slice's room is given back


def test_a_slice_being_filled_is_charged_to_the_inbox_and_only_one_per_stream(inbox):
    assembler = SliceAssembler(inbox, "grpc", CONSUMER)
    assembler.add(Chunk(slice_bytes=4096), bytes(100))
    assert inbox.held == 4096  # before its bytes are all there
    with pytest.raises(ChannelError, match="another slice"):
        assembler.add(Chunk(transfer_id="t-2", slice_bytes=4096), bytes(100))
    assert inbox.allocated == [4096]
    assembler.abandon("stream failed")
    assert inbox.held == 0
    assert inbox.take()[1] == {"t-1": Cancel(Failure.CANCELLED, "stream failed")}


def test_partial_slices_cannot_take_more_than_the_inbox():
    """1000 streams each starting a big slice: each waits for room, none is allocated past it."""
    box = Inbox(max_bytes=1 << 20, wait_s=0.1, verify=False)
    first = SliceAssembler(box, "grpc", CONSUMER)
    first.add(Chunk(slice_bytes=1 << 20), b"x")
    started = time.monotonic()
    with pytest.raises(ChannelError, match="stayed full"):
        SliceAssembler(box, "grpc", CONSUMER).add(Chunk(transfer_id="t-2", slice_bytes=64), b"x")
    assert time.monotonic() - started < 2
    assert box.held == 1 << 20


def test_a_whole_slice_fills_once_and_reaches_the_inbox(inbox):
    assembler = SliceAssembler(inbox, "grpc", CONSUMER)
    assembler.add(Chunk(slice_bytes=16), bytes(range(8)))
    assembler.add(Chunk(offset=8, slice_bytes=16), bytes(range(8, 16)))
    (arrived,), _ = inbox.take()
    assert bytes(arrived.data) == bytes(range(16)) and inbox.held == 16
    arrived.release()
    assert inbox.held == 0


@pytest.mark.parametrize(
    ("asked", "used"),
    [(0.0, GROUP_TIMEOUT_S), (1e20, GROUP_TIMEOUT_S), (1e9, GROUP_TIMEOUT_S), (0.01, 1.0)]
    + [(math.nan, GROUP_TIMEOUT_S), (math.inf, GROUP_TIMEOUT_S), (-5.0, GROUP_TIMEOUT_S)]
    + [(7.5, 7.5)],
)
def test_the_nccl_group_timeout_a_sender_asks_for_is_clamped(asked, used):
    assert group_timeout(asked) == used


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_stream_that_fails_with_any_exception_cancels_what_it_carried(receiver, transport):
    """A MemoryError (or ValueError, OverflowError) on the receiving end is a stream failure
    like any other: the receiver cancels the stream's transfers now, not at their deadline
    (the channel alone here: no KvSender to cancel them from its side)."""
    kv_receiver, address = receiver
    channel = (GrpcChannel if transport == "grpc" else ShmChannel)(address, CONSUMER)
    try:
        channel.send(sealed(piece("t-1", 64, layer=0, last=False)))
        got, _ = take_until(kv_receiver, slices=1)
        for arrived in got:
            arrived.release()
        del got, arrived

        def out_of_memory(size):
            raise MemoryError(f"cannot allocate {size} bytes")

        kv_receiver.inbox.new_buffer = out_of_memory
        with contextlib.suppress(ChannelError):  # shm: more than a segment, so copied out
            channel.send(sealed(piece("t-1", 12 << 20, layer=1)))
        cancelled = take_until(kv_receiver, cancels={"t-1"})[1]
        assert cancelled["t-1"].failure == Failure.CANCELLED
        assert "cannot allocate" in cancelled["t-1"].reason
        assert kv_receiver.inbox.held == 0
    finally:
        with contextlib.suppress(ChannelError):
            channel.close()
