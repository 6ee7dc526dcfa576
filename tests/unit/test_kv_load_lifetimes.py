"""The decode side's load lifetimes (kv_transfer/host_staging.HostToDevice, as the KV loader
drives it): on CUDA a scatter queued on the side stream reads its tensors later than it is
queued, so a received buffer, a prefix-cache skip's `wire[keep]`, the index, and the slice's
release (which lends its buffer to the next receive) must outlive an event recorded after it.
A fake stream that defers every submitted work until the test runs it makes that visible on CPU:
released too early, the next receive would take the buffer and overwrite it before the scatter
read it. The same fake shows that vLLM's thread never waits for the stream: a transfer is
reported once an event after its last scatter has passed (a query), never by a synchronize."""

import gc
import weakref

import torch

from decode_workers.kv_loader import KvLoader
from kv_transfer.host_staging import HostToDevice
from kv_transfer.integrity import transfer_epoch
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout
from kv_transfer.metadata import Expected
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import Inbox, LayerSlice

LAYOUT = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
BLOCK_SHAPE = (2, 4, 8)  # heads, block size, K|V of head size 4
HEAD_SIZE = 4
BLOCK_BYTES = torch.Size(BLOCK_SHAPE).numel() * 4


class FakeDeferringStream:
    """Stands in for a CUDA side stream: submitted work runs only when the test says the stream
    got there (`run()`), as queued kernels run later; an event has passed once everything
    queued before it has run."""

    def __init__(self) -> None:
        self.queued: list = []
        self.ran = 0
        self.synchronized = 0  # what the loader must never do on vLLM's thread
        self.forward_waits_for: list[int] = []  # the forward stream waits for the first N works

    def follow_forward(self) -> None:
        pass

    def precede_forward(self) -> None:
        self.forward_waits_for.append(self.ran + len(self.queued))

    def submit(self, work) -> None:
        self.queued.append(work)

    def record(self):
        return FakeEvent(self, self.ran + len(self.queued))

    def run(self) -> None:
        while self.queued:
            self.queued.pop(0)()
            self.ran += 1

    def synchronize(self) -> None:
        self.synchronized += 1
        self.run()


class FakeEvent:
    def __init__(self, stream: FakeDeferringStream, position: int) -> None:
        self.stream, self.position = stream, position

    def query(self) -> bool:
        return self.stream.ran >= self.position


def loader_with_fake_stream(inbox: Inbox):
    caches = [torch.zeros(6, *BLOCK_SHAPE) for _ in range(2)]
    loader = KvLoader(inbox, caches, LAYOUT, HEAD_SIZE, total_heads=2)
    stream = FakeDeferringStream()
    loader.staging = HostToDevice(torch.device("cpu"), side_stream=stream)
    return loader, caches, stream


def received(inbox: Inbox, layer: int, values: torch.Tensor, last: bool = True) -> bytearray:
    """A slice of `values` (blocks of one layer) received into a buffer from the inbox."""
    raw = values.view(torch.uint8).reshape(-1)
    buffer = inbox.buffer(raw.numel())
    buffer[:] = raw.numpy().tobytes()
    inbox.put(
        LayerSlice(
            "t",
            layer,
            0,
            values.shape[0],
            0,
            2,
            buffer,
            last,
            0.0,
            "gloo",
            epoch=transfer_epoch("t"),
            seq=layer,
        )  # fmt: skip
    )
    return buffer


def test_a_received_buffer_is_not_lent_to_the_next_receive_before_its_scatter_ran():
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    sent = torch.full((2, *BLOCK_SHAPE), 7.0)
    buffer = received(inbox, 0, sent)
    assert loader.transfer_results([Expected("r", "t", [3, 4], 0, 5.0)], set()) == (set(), set())
    # The scatter is queued, not run: the buffer is still the slice's, so the next receive gets
    # another one and cannot overwrite what the scatter will read.
    assert inbox.held == 2 * BLOCK_BYTES
    other = inbox.buffer(len(buffer))
    assert other is not buffer
    other[:] = bytes(len(other))  # what the next receive writes
    stream.run()
    assert torch.equal(caches[0][3:5], sent)
    loader.transfer_results([], set())  # the event has passed: released now
    assert inbox.held == 0
    assert inbox.buffer(len(buffer)) is buffer  # lent to the next receive only now


def test_a_prefix_skip_copy_and_the_index_live_until_the_event_then_go():
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    sent = torch.stack([torch.full(BLOCK_SHAPE, float(value)) for value in (1, 2, 3)])
    received(inbox, 0, sent)
    # Block 3 holds this worker's own prefix hit; 5 and 4 are not consecutive: an indexed copy.
    expected = Expected("r", "t", [3, 5, 4], 1, 5.0)
    loader.transfer_results([expected], set())
    [(event, held, _)] = loader.staging.in_flight
    assert not event.query()
    shapes = sorted(tuple(tensor.shape) for tensor in held)
    assert shapes == [(2,), (2, 2, 4, 2, HEAD_SIZE)]  # the index, and wire[keep] (wire order)
    alive = [weakref.ref(tensor) for tensor in held]
    del held, event
    gc.collect()
    assert all(ref() is not None for ref in alive), "freed before the stream read it"
    stream.run()
    loader.transfer_results([], set())
    assert loader.staging.in_flight == []
    gc.collect()
    assert all(ref() is None for ref in alive), "held after the event: a leak"
    assert torch.equal(caches[0][5], sent[1]) and torch.equal(caches[0][4], sent[2])
    assert not caches[0][3].any()


def test_a_transfer_is_reported_once_its_scatters_landed_without_waiting_for_the_stream():
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    sent = torch.full((2, *BLOCK_SHAPE), 5.0)
    received(inbox, 0, sent)
    received(inbox, 1, sent)
    expected = Expected("r", "t", [1, 2], 0, 5.0)
    # Every slice is in, the scatters are queued: not reported yet, and nothing waited for them.
    assert loader.transfer_results([expected], set()) == (set(), set())
    assert loader.transfer_results([], set()) == (set(), set())
    assert len(stream.queued) == 2 and inbox.held == 4 * BLOCK_BYTES  # two slices held
    stream.run()
    assert loader.transfer_results([], set()) == ({"r"}, set())
    assert stream.synchronized == 0
    assert loader.staging.in_flight == [] and inbox.held == 0
    assert all(torch.equal(cache[1:3], sent) for cache in caches)
    assert loader.transfer_results([], set()) == (set(), set())  # reported once
    assert [report.transfer_id for report in loader.take_reports()] == ["t"]


def test_an_aborted_transfer_frees_its_blocks_only_after_its_queued_scatter_ran():
    """vLLM hands an aborted request's blocks to the next request once it is reported: a
    scatter still queued into them would overwrite that request's KV."""
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    received(inbox, 0, torch.full((2, *BLOCK_SHAPE), 3.0), last=True)
    loader.transfer_results([Expected("r", "t", [1, 2], 0, 5.0)], set())
    assert loader.transfer_results([], {"r"}) == (set(), set())  # aborted, scatter queued
    assert loader.transfer_results([], set()) == (set(), set())  # the outcome stays aborted
    stream.run()
    assert loader.transfer_results([], set()) == ({"r"}, set())
    assert stream.synchronized == 0


def test_a_failed_transfer_aborted_before_its_copies_landed_is_reported_as_aborted():
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    received(inbox, 0, torch.full((2, *BLOCK_SHAPE), 3.0), last=True)
    inbox.cancel("t", Cancel(Failure.CANCELLED, "the prefill worker failed"))
    assert loader.transfer_results([Expected("r", "t", [1, 2], 0, 5.0)], set()) == (set(), set())
    loader.transfer_results([], {"r"})  # its request is gone before the scatter ran
    stream.run()
    assert loader.transfer_results([], set()) == ({"r"}, set())  # not a failure: vLLM frees it
    assert stream.synchronized == 0


def test_a_slice_after_the_outcome_is_dropped_not_loaded():
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    sent = torch.full((2, *BLOCK_SHAPE), 5.0)
    received(inbox, 0, sent)
    received(inbox, 1, sent)
    loader.transfer_results([Expected("r", "t", [1, 2], 0, 5.0)], set())  # complete, queued
    received(inbox, 1, torch.full((2, *BLOCK_SHAPE), 9.0))  # a late slice before the report
    loader.transfer_results([], set())
    assert len(stream.queued) == 2  # not queued: the transfer's outcome was already known
    stream.run()
    assert loader.transfer_results([], set()) == ({"r"}, set())
    assert inbox.held == 0
    assert all(torch.equal(cache[1:3], sent) for cache in caches)


def test_without_cuda_nothing_is_pinned():
    """Pinned memory exists only beside CUDA (pin_memory raises on a CPU-only torch): on CPU
    receive buffers are bytearrays and indexes plain tensors."""
    staging = HostToDevice(torch.device("cpu"))
    assert type(staging.receive_buffer(16)) is bytearray
    index = staging.index([3, 1])
    assert index.dtype == torch.long and index.tolist() == [3, 1]
    assert staging.mark() is None and staging.passed(None)


def test_a_synchronous_load_makes_the_forward_stream_wait_on_the_gpu_not_vllms_thread():
    """KV loaded in the step that computes from it: the forward stream waits for every queued
    scatter (a GPU-side wait), vLLM's thread for none; the slices go back once they ran."""
    inbox = Inbox(verify=False)
    loader, caches, stream = loader_with_fake_stream(inbox)
    sent = torch.full((2, *BLOCK_SHAPE), 4.0)
    received(inbox, 0, sent)
    received(inbox, 1, sent)
    loader.load_now([Expected("r", "t", [1, 2], 0, 5.0)])
    assert stream.forward_waits_for == [2] and stream.synchronized == 0
    assert loader.take_load_errors() == set() and inbox.held == 4 * BLOCK_BYTES
    stream.run()
    assert loader.transfer_results([], set()) == (set(), set())  # scheduled already: no report
    assert inbox.held == 0
    assert all(torch.equal(cache[1:3], sent) for cache in caches)
