"""A transfer whose decode leg will not run must not hold the decode rank's KV inbox (security
review 2026-12, H6; reproductions/poc_orphan_inbox.py): the real Inbox, scaled down to 4 KiB,
feeds the real KV loader; a cancel frees the slices that came for a transfer no request
expects at the next engine step, and drops those that come after it, so the next transfer
gets in at once instead of after ORPHAN_TTL_S."""

import time

import pytest
import torch

from decode_workers.kv_loader import ORPHAN_TTL_S, KvLoader
from kv_transfer.integrity import slice_digest, transfer_epoch
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout
from kv_transfer.metadata import Expected
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import Inbox, LayerSlice
from tests.fakes import FakeClock

INBOX_BYTES = 4096
WAIT_S = 0.3


class Receiver:
    """The KvReceiver's `take()`, over a real inbox."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def take(self):
        return self.inbox.take()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def inbox() -> Inbox:
    return Inbox(max_bytes=INBOX_BYTES, wait_s=WAIT_S)


@pytest.fixture
def loader(inbox, clock) -> KvLoader:
    caches = [torch.zeros(10, 2, 4, 8) for _ in range(2)]
    layout = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
    return KvLoader(Receiver(inbox), caches, layout, 4, total_heads=2, clock=clock)


def piece(transfer_id: str, layer: int, size: int, at: float) -> LayerSlice:
    data = bytearray(size)
    return LayerSlice(
        transfer_id,
        layer,
        0,
        1,
        0,
        2,
        data,
        True,
        received_at=at,
        epoch=transfer_epoch(transfer_id),
        digest=slice_digest(torch.frombuffer(data, dtype=torch.uint8)),
    )


def test_a_cancel_frees_an_orphans_room_at_the_next_step_and_the_next_transfer_gets_in(
    inbox, loader, clock
):
    inbox.put(piece("orphan", 0, 2048, clock.now))  # its KV fills the inbox ...
    inbox.put(piece("orphan", 1, 2048, clock.now))
    inbox.cancel("orphan", Cancel(Failure.CANCELLED, "no decode leg: the first token ended it"))
    loader.transfer_results([], set())  # ... one engine step
    assert inbox.held == 0
    assert loader.orphans == {}
    started = time.monotonic()
    inbox.put(piece("next-request", 0, 512, clock.now))  # raised ChannelError after WAIT_S
    assert time.monotonic() - started < WAIT_S
    assert inbox.held == 512


def test_slices_that_come_after_their_transfers_cancel_are_dropped_at_once(inbox, loader, clock):
    inbox.cancel("orphan", Cancel(Failure.CANCELLED, "no decode leg: the request ended first"))
    loader.transfer_results([], set())
    inbox.put(piece("orphan", 0, 2048, clock.now))  # still on its way when the cancel came
    inbox.put(piece("orphan", 1, 2048, clock.now))
    loader.transfer_results([], set())
    assert inbox.held == 0 and loader.orphans == {}


def test_a_request_that_comes_after_its_transfers_cancel_fails_at_once(inbox, loader, clock):
    inbox.put(piece("t-1", 0, 2048, clock.now))
    inbox.cancel("t-1", Cancel(Failure.CANCELLED, "prefill worker failed: gone"))
    loader.transfer_results([], set())
    clock.advance(1.0)
    entry = Expected("req-1", "t-1", [7], 0, 5.0)
    assert loader.transfer_results([entry], set()) == ({"req-1"}, {"req-1"})


def test_orphans_with_no_cancel_still_wait_for_their_request(inbox, loader, clock):
    """The after-prefill path: the KV comes before the decode leg; nothing is dropped early."""
    inbox.put(piece("t-1", 0, 2048, clock.now))
    loader.transfer_results([], set())
    clock.advance(ORPHAN_TTL_S / 2)
    loader.transfer_results([], set())
    assert set(loader.orphans) == {"t-1"} and inbox.held == 2048
