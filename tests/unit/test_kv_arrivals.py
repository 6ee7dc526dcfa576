"""The ranks' arrival notices and the scheduler half's board (decode_workers/arrivals.py), over
a real abstract Unix datagram socket in this process (as with vLLM's uni-process executor): the
board says a transfer arrived only once every rank announced every sender routed to it, and
not for a slice that failed a check, a stale notice, or a datagram that is not a notice."""

import socket
import uuid
from dataclasses import replace

import pytest

from decode_workers.arrivals import NOTICE_TTL_S, ArrivalBoard, ArrivalNotices, arrivals_address
from kv_transfer.integrity import Damage, transfer_epoch
from kv_transfer.transport import LayerSlice
from tests.fakes import FakeClock

NUM_LAYERS = 2


@pytest.fixture
def address():
    return arrivals_address(str(uuid.uuid4()), 0)


def piece(layer, first_head=0, last=True, transfer_id="t", seq=None, **fields) -> LayerSlice:
    """A slice as the inbox holds it; one sender's sequence numbers go layer by layer."""
    return LayerSlice(
        transfer_id,
        layer,
        0,
        1,
        first_head,
        1,
        b"",
        last,
        epoch=transfer_epoch(transfer_id),
        seq=layer if seq is None else seq,
        **fields,
    )


def whole(notices: ArrivalNotices, first_head=0, transfer_id="t") -> None:
    for layer in range(NUM_LAYERS):
        notices.landed(piece(layer, first_head, transfer_id=transfer_id))


def test_a_transfer_arrived_once_every_rank_announced_it(address):
    """TP 2 decode, 2 KV heads: each rank takes one head from the one prefill rank."""
    board = ArrivalBoard(address, tp=2, total_heads=2)
    rank0, rank1 = (ArrivalNotices(address, rank, NUM_LAYERS) for rank in (0, 1))
    try:
        rank0.landed(piece(0, first_head=0))
        assert not board.arrived("t", prefill_tp=1)
        rank0.landed(piece(1, first_head=0))
        assert not board.arrived("t", prefill_tp=1)  # rank 1 holds nothing yet
        whole(rank1, first_head=1)
        assert board.arrived("t", prefill_tp=1)
        assert not board.arrived("other", prefill_tp=1)
    finally:
        board.close()
        rank0.close()
        rank1.close()


def test_a_rank_fed_by_two_prefill_ranks_needs_both(address):
    """TP 2 prefill into TP 1 decode: two senders, each its own heads, each ending each layer."""
    board = ArrivalBoard(address, tp=1, total_heads=2)
    notices = ArrivalNotices(address, 0, NUM_LAYERS)
    try:
        whole(notices, first_head=0)
        assert board.arrived("t", prefill_tp=1)  # had the prefill been one rank
        assert not board.arrived("t", prefill_tp=2)
        for layer in range(NUM_LAYERS):
            notices.landed(piece(layer, first_head=1, seq=layer))
        assert board.arrived("t", prefill_tp=2)
    finally:
        board.close()
        notices.close()


@pytest.mark.parametrize(
    "spoiled",
    [
        {"damage": Damage.DIGEST},
        {"epoch": transfer_epoch("another transfer")},
        {"seq": 0},  # layer 1's slice numbered as layer 0's: a duplicate
    ],
    ids=["digest", "stale", "duplicate"],
)
def test_a_slice_failing_a_check_stops_its_transfers_notices(address, spoiled):
    board = ArrivalBoard(address, tp=1, total_heads=2)
    notices = ArrivalNotices(address, 0, NUM_LAYERS)
    try:
        notices.landed(piece(0))
        notices.landed(replace(piece(1), **spoiled))
        notices.landed(piece(1, seq=5))  # whatever comes after
        assert not board.arrived("t", prefill_tp=1)
    finally:
        board.close()
        notices.close()


def test_a_stale_notice_is_not_believed(address):
    clock = FakeClock()
    board = ArrivalBoard(address, tp=1, total_heads=2, clock=clock)
    notices = ArrivalNotices(address, 0, NUM_LAYERS)
    try:
        whole(notices)
        assert board.arrived("t", prefill_tp=1)
        clock.advance(NOTICE_TTL_S + 1)
        assert not board.arrived("t", prefill_tp=1)
    finally:
        board.close()
        notices.close()


def test_what_is_not_a_notice_is_ignored_and_a_missing_board_loses_nothing(address):
    notices = ArrivalNotices(address, 0, NUM_LAYERS)
    whole(notices, transfer_id="before")  # no board listening yet: dropped, no error
    board = ArrivalBoard(address, tp=1, total_heads=2)
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        stranger.sendto(b"not json", address)
        stranger.sendto(b'{"transfer_id": "t"}', address)
        assert not board.arrived("t", prefill_tp=1)
        assert not board.arrived("before", prefill_tp=1)
        whole(notices)
        assert board.arrived("t", prefill_tp=1)
    finally:
        stranger.close()
        board.close()
        notices.close()


def test_a_board_that_cannot_listen_answers_never(address):
    first = ArrivalBoard(address, tp=1, total_heads=2)
    second = ArrivalBoard(address, tp=1, total_heads=2)  # the name is taken
    notices = ArrivalNotices(address, 0, NUM_LAYERS)
    try:
        whole(notices)
        assert second.socket is None and not second.arrived("t", prefill_tp=1)
        assert first.arrived("t", prefill_tp=1)
    finally:
        first.close()
        second.close()
        notices.close()
