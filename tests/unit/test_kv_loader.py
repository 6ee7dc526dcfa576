"""The decode worker's KV loader state machine (decode_workers/kv_loader.py), step by step: a
fake receiver hands over the slices and cancels of each engine step, a fake clock stands in for
the monotonic clock, and small real torch tensors are the KV caches, so every byte's landing
place can be checked. No engine, no network."""

import logging
from dataclasses import replace

import pytest
import torch

from decode_workers.kv_loader import ORPHAN_TTL_S, KvLoader
from kv_transfer.integrity import transfer_epoch
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout
from kv_transfer.metadata import Expected
from kv_transfer.transfer_report import Cancel, Failure, TransferReport
from kv_transfer.transport import LayerSlice
from tests.fakes import FakeClock

NUM_LAYERS = 2
NUM_BLOCKS = 10
# One block of vLLM 0.32's layer view: (KV heads, block size, K|V content = 2 * head size).
BLOCK_SHAPE = (2, 4, 8)
HEAD_SIZE = 4
LAYOUT = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
TIMEOUT_S = 5.0


class FakeReceiver:
    """Stands in for kv_transfer.kv_receiver.KvReceiver: `take()` hands over what the test
    fed it since the last step (complete slices, {transfer id: cancel reason})."""

    def __init__(self) -> None:
        self.slices: list[LayerSlice] = []
        self.cancels: dict[str, Cancel] = {}

    def feed(self, slices=(), cancels=None) -> None:
        self.slices.extend(slices)
        self.cancels.update(cancels or {})

    def take(self) -> tuple[list[LayerSlice], dict[str, str]]:
        slices, self.slices = self.slices, []
        cancels, self.cancels = self.cancels, {}
        return slices, cancels


@pytest.fixture
def receiver() -> FakeReceiver:
    return FakeReceiver()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def loader(receiver, clock) -> KvLoader:
    caches = [torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE) for _ in range(NUM_LAYERS)]
    loader = KvLoader(receiver, caches, LAYOUT, HEAD_SIZE, total_heads=2, clock=clock)
    loader.kv_caches = caches  # the tests read the caches back
    return loader


def expected(req_id="req-1", transfer_id="t-1", block_ids=(7, 2, 5, 9), skip_blocks=0):
    return Expected(req_id, transfer_id, list(block_ids), skip_blocks, TIMEOUT_S)


def block_values(layer: int, first_block: int, num_blocks: int) -> torch.Tensor:
    """KV of `num_blocks` request blocks from `first_block`: each block filled with a value
    that names its layer and request block (never 0, which is what empty cache blocks hold)."""
    rows = [
        torch.full(BLOCK_SHAPE, 100.0 * (layer + 1) + first_block + i) for i in range(num_blocks)
    ]
    return torch.stack(rows)


def layer_slice(
    layer, first_block=0, num_blocks=4, last=True, transfer_id="t-1", at=0.0, seq=None, **fields
):
    """A slice as a sender makes it: its transfer's epoch, and a sequence number in the order
    a sender sends (step by step, layer by layer) unless `seq` is given."""
    data = bytearray(block_values(layer, first_block, num_blocks).numpy().tobytes())
    return LayerSlice(
        transfer_id,
        layer,
        first_block,
        num_blocks,
        0,
        2,
        data,
        last,
        at,
        "shm",
        epoch=transfer_epoch(transfer_id),
        seq=first_block * NUM_LAYERS + layer if seq is None else seq,
        **fields,
    )


def whole_prompt(transfer_id="t-1", num_blocks=4, at=0.0) -> list[LayerSlice]:
    return [
        layer_slice(layer, 0, num_blocks, transfer_id=transfer_id, at=at)
        for layer in range(NUM_LAYERS)
    ]


def test_a_transfer_whose_every_layer_arrived_is_reported_loaded_once(loader, receiver):
    receiver.feed(whole_prompt())
    assert loader.transfer_results([expected()], set()) == ({"req-1"}, set())
    assert loader.transfer_results([], set()) == (set(), set())
    assert loader.incoming == {}


def test_a_transfer_is_not_loaded_until_the_last_slice_of_every_layer(loader, receiver):
    receiver.feed([layer_slice(0), layer_slice(1, num_blocks=2, last=False)])
    assert loader.transfer_results([expected()], set()) == (set(), set())
    receiver.feed([layer_slice(1, first_block=2, num_blocks=2, last=True)])
    assert loader.transfer_results([], set()) == ({"req-1"}, set())


def test_the_kv_lands_in_the_expected_blocks_past_the_skipped_prefix(loader, receiver):
    block_ids = [7, 2, 5, 9]
    receiver.feed(
        [
            layer_slice(0, first_block=0, num_blocks=2, last=False),
            layer_slice(1, first_block=0, num_blocks=4, last=True),
            layer_slice(0, first_block=2, num_blocks=2, last=True),
        ]
    )
    loader.transfer_results([expected(block_ids=block_ids, skip_blocks=1)], set())
    for layer, cache in enumerate(loader.kv_caches):
        sent = block_values(layer, 0, 4)
        # Block 7 holds the decode worker's own prefix-cache hit: left alone.
        assert torch.count_nonzero(cache[7]) == 0
        for request_block in (1, 2, 3):
            assert torch.equal(cache[block_ids[request_block]], sent[request_block])
        untouched = [b for b in range(NUM_BLOCKS) if b not in block_ids]
        assert torch.count_nonzero(cache[untouched]) == 0


def test_a_transfer_past_its_deadline_is_reported_failed_once(loader, clock, caplog):
    assert loader.transfer_results([expected()], set()) == (set(), set())
    clock.advance(TIMEOUT_S)  # at the deadline, not past it
    assert loader.transfer_results([], set()) == (set(), set())
    clock.advance(0.01)
    with caplog.at_level(logging.WARNING, logger="pdserve.kv"):
        assert loader.transfer_results([], set()) == ({"req-1"}, {"req-1"})
    assert "t-1" in caplog.text and "no KV after 5 s" in caplog.text
    clock.advance(60.0)
    assert loader.transfer_results([], set()) == (set(), set())


def test_a_partly_arrived_transfer_past_its_deadline_fails(loader, receiver, clock):
    receiver.feed([layer_slice(0)])
    loader.transfer_results([expected()], set())
    clock.advance(TIMEOUT_S + 1)
    assert loader.transfer_results([], set()) == ({"req-1"}, {"req-1"})


def test_a_cancelled_transfer_fails_at_once_with_its_reason_logged(loader, receiver, caplog):
    loader.transfer_results([expected()], set())
    receiver.feed(cancels={"t-1": Cancel(Failure.CANCELLED, "prefill worker failed: no memory")})
    with caplog.at_level(logging.WARNING, logger="pdserve.kv"):
        assert loader.transfer_results([], set()) == ({"req-1"}, {"req-1"})
    assert "prefill worker failed: no memory" in caplog.text
    assert loader.transfer_results([], set()) == (set(), set())


@pytest.mark.parametrize("failure", [Failure.REFUSED, Failure.CANCELLED])
def test_a_failed_transfer_reports_the_failure_its_cancel_named(loader, receiver, failure):
    loader.transfer_results([expected()], set())
    receiver.feed(cancels={"t-1": Cancel(failure, "whatever the sender said")})
    loader.transfer_results([], set())
    [report] = loader.take_reports()
    assert (report.failed, report.failure) == (True, failure)


def test_a_cancel_that_comes_before_its_request_fails_the_request_when_it_comes(
    loader, receiver, clock
):
    receiver.feed(cancels={"t-1": Cancel(Failure.CANCELLED, "prefill worker failed")})
    assert loader.transfer_results([], set()) == (set(), set())
    clock.advance(1.0)
    assert loader.transfer_results([expected()], set()) == ({"req-1"}, {"req-1"})


def test_a_cancel_no_request_claimed_within_the_ttl_is_forgotten(loader, receiver, clock):
    receiver.feed(cancels={"t-1": Cancel(Failure.CANCELLED, "prefill worker failed")})
    loader.transfer_results([], set())
    clock.advance(ORPHAN_TTL_S + 1)
    loader.transfer_results([], set())
    assert loader.cancelled == {}
    receiver.feed(whole_prompt())
    assert loader.transfer_results([expected()], set()) == ({"req-1"}, set())


def test_an_aborted_request_is_reported_loaded_so_its_blocks_are_freed(loader, receiver):
    receiver.feed([layer_slice(0)])  # half its KV, then the client went away
    assert loader.transfer_results([expected()], set()) == (set(), set())
    assert loader.transfer_results([], {"req-1"}) == ({"req-1"}, set())
    assert loader.incoming == {}
    assert loader.transfer_results([], {"req-1"}) == (set(), set())


def test_slices_that_come_before_their_request_are_loaded_when_it_comes(loader, receiver, clock):
    receiver.feed(whole_prompt(at=clock.now))
    assert loader.transfer_results([], set()) == (set(), set())
    assert set(loader.orphans) == {"t-1"}
    clock.advance(1.0)
    assert loader.transfer_results([expected(block_ids=[3, 4, 6, 8])], set()) == (
        {"req-1"},
        set(),
    )
    assert loader.orphans == {}
    assert torch.equal(loader.kv_caches[1][8], block_values(1, 0, 4)[3])


def test_orphan_slices_older_than_the_ttl_are_dropped(loader, receiver, clock):
    receiver.feed(whole_prompt(at=clock.now))
    loader.transfer_results([], set())
    clock.advance(ORPHAN_TTL_S)  # exactly the TTL old: still kept
    loader.transfer_results([], set())
    assert set(loader.orphans) == {"t-1"}
    clock.advance(0.5)
    loader.transfer_results([], set())
    assert loader.orphans == {}
    # The request that comes now gets no KV: it waits, then fails at its deadline.
    assert loader.transfer_results([expected()], set()) == (set(), set())
    assert torch.count_nonzero(loader.kv_caches[0]) == 0
    clock.advance(TIMEOUT_S + 1)
    assert loader.transfer_results([], set()) == ({"req-1"}, {"req-1"})


def test_orphan_age_is_measured_from_when_the_slice_was_received(loader, receiver, clock):
    # Received long ago on the receiver's thread, handed over only now: already too old.
    receiver.feed(whole_prompt(at=clock.now - ORPHAN_TTL_S - 1))
    loader.transfer_results([], set())
    assert loader.orphans == {}


def test_stats_give_bytes_and_first_to_last_slice_time_per_finished_transfer(
    loader, receiver, clock
):
    slices = [
        layer_slice(0, at=clock.now - 0.5),
        layer_slice(1, at=clock.now - 0.25),
    ]
    receiver.feed(slices)
    loader.transfer_results([expected()], set())
    [report] = loader.take_reports()
    assert report == TransferReport(
        "t-1",
        sum(len(piece.data) for piece in slices),
        pytest.approx(0.25),
        transports=frozenset({"shm"}),
    )
    assert report.bytes == NUM_LAYERS * 4 * torch.zeros(BLOCK_SHAPE).numel() * 4
    assert not report.failed and report.damage is None
    assert loader.take_reports() == []


def test_stats_of_a_failed_transfer_run_to_the_failure_and_say_failed(loader, receiver, clock):
    receiver.feed([layer_slice(0, at=clock.now)])
    loader.transfer_results([expected()], set())
    assert loader.take_reports() == []  # nothing finished yet
    clock.advance(TIMEOUT_S + 1)
    loader.transfer_results([], set())
    [report] = loader.take_reports()
    assert (report.failed, report.failure) == (True, Failure.TIMEOUT)
    assert report.bytes == len(layer_slice(0).data)
    assert report.seconds == pytest.approx(TIMEOUT_S + 1)
    assert loader.take_reports() == []


def test_each_of_two_transfers_is_reported_on_its_own(loader, receiver, clock):
    receiver.feed(whole_prompt("t-1"))
    receiver.feed([layer_slice(0, transfer_id="t-2")])
    first = expected("req-1", "t-1", block_ids=[0, 1, 2, 3])
    second = expected("req-2", "t-2", block_ids=[4, 5, 6, 7])
    assert loader.transfer_results([first, second], set()) == ({"req-1"}, set())
    clock.advance(TIMEOUT_S + 1)
    assert loader.transfer_results([], set()) == ({"req-2"}, {"req-2"})
    assert [report.transfer_id for report in loader.take_reports()] == ["t-1", "t-2"]


def released_slices(slices: list[LayerSlice], releases: list[str]) -> list[LayerSlice]:
    """The slices, each noting "transfer/layer" in `releases` when released."""
    return [
        replace(piece, on_release=lambda p=piece: releases.append(f"{p.transfer_id}/{p.layer}"))
        for piece in slices
    ]


def test_every_slice_frees_its_inbox_room_once_loaded_dropped_or_late(loader, receiver, clock):
    releases: list[str] = []
    receiver.feed(released_slices(whole_prompt("t-1"), releases))
    loader.transfer_results([expected()], set())
    assert sorted(releases) == ["t-1/0", "t-1/1"]  # loaded: copied into the cache
    receiver.feed(released_slices([layer_slice(0, transfer_id="t-1")], releases))
    loader.transfer_results([], set())
    assert releases.count("t-1/0") == 2  # late, for a transfer already reported: dropped now
    orphan = layer_slice(0, transfer_id="nobody", at=clock.now)
    receiver.feed(released_slices([orphan], releases))
    loader.transfer_results([], set())
    assert "nobody/0" not in releases  # an orphan waits for its request a while
    clock.advance(ORPHAN_TTL_S + 1)
    loader.transfer_results([], set())
    assert "nobody/0" in releases


def test_an_abandoned_transfer_frees_what_came_drops_what_comes_and_says_why(
    loader, receiver, clock
):
    """The decode worker computes the request itself (it lacked blocks the prefill worker
    skipped): the slices that came before are freed at once, later ones as they come, and the
    transfer is reported failed, not held, once."""
    releases: list[str] = []
    receiver.feed(released_slices([layer_slice(0, transfer_id="t-9", at=clock.now)], releases))
    loader.transfer_results([], set())
    assert "t-9/0" not in releases  # an orphan, waiting for its request
    loader.abandon(["t-9"])
    assert releases == ["t-9/0"] and loader.orphans == {}
    receiver.feed(released_slices([layer_slice(1, transfer_id="t-9")], releases))
    assert loader.transfer_results([], set()) == (set(), set())
    assert releases == ["t-9/0", "t-9/1"]
    [report] = loader.take_reports()
    assert (report.transfer_id, report.failure) == ("t-9", Failure.NOT_HELD)
    assert report.failure == "not_held"  # what the router reads (pdserve.core.kinds.KV_NOT_HELD)


def test_kv_loaded_in_its_requests_step_fills_the_blocks_before_the_forward(loader, receiver):
    """The scheduler half chose a synchronous load: the loader copies what arrived now (vLLM
    calls start_load_kv before the step's forward), reports the transfer (in its request's
    step), and never reports it loaded later (vLLM scheduled the request already)."""
    receiver.feed(whole_prompt())
    loader.load_now([expected(block_ids=[7, 2, 5, 9], skip_blocks=1)])
    assert loader.take_load_errors() == set()
    for layer, cache in enumerate(loader.kv_caches):
        sent = block_values(layer, 0, 4)
        assert torch.count_nonzero(cache[7]) == 0  # this worker's own prefix hit
        assert all(torch.equal(cache[b], sent[i]) for i, b in enumerate([7, 2, 5, 9]) if i)
    (report,) = loader.take_reports()
    assert (report.failure, report.in_step, report.bytes) == (None, True, 2 * 4 * 2 * 4 * 8 * 4)
    assert loader.transfer_results([], set()) == (set(), set())
    assert loader.incoming == {}


def test_a_slice_failing_integrity_in_a_synchronous_load_is_a_load_error(loader, receiver):
    """Chosen synchronously, found unsound at load: its blocks past the local hit are load
    errors (vLLM recomputes or fails the request, and drops the step's token), never a loaded
    result."""
    damaged = replace(layer_slice(1), epoch=transfer_epoch("another transfer"))
    receiver.feed([layer_slice(0), damaged])
    loader.load_now([expected(block_ids=[7, 2, 5, 9], skip_blocks=1)])
    assert loader.take_load_errors() == {2, 5, 9}
    assert loader.take_load_errors() == set()  # told once
    (report,) = loader.take_reports()
    assert report.failure == Failure.INTEGRITY and report.in_step
    assert loader.transfer_results([], set()) == (set(), set())  # not a loaded (or failed) one
    receiver.feed([layer_slice(1)])  # a slice after the load: dropped, not kept as an orphan
    loader.transfer_results([], set())
    assert loader.orphans == {}


def test_a_slice_missing_in_a_synchronous_load_is_a_load_error(loader, receiver):
    receiver.feed([layer_slice(0)])  # layer 1 never came (its orphan was dropped, say)
    loader.load_now([expected()])
    assert loader.take_load_errors() == {7, 2, 5, 9}
    (report,) = loader.take_reports()
    assert report.failure == Failure.TIMEOUT and report.in_step


def test_a_cancelled_transfer_in_a_synchronous_load_is_a_load_error(loader, receiver):
    receiver.feed([layer_slice(0)], {"t-1": Cancel(Failure.CANCELLED, "the sender failed")})
    loader.load_now([expected()])
    assert loader.take_load_errors() == {7, 2, 5, 9}
    assert loader.take_reports()[0].failure == Failure.CANCELLED
