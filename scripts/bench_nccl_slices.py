"""Slices per second over one nccl channel, against a fake NCCL pair group (CPU: no GPU needed).

    python3 scripts/bench_nccl_slices.py                     # the table, 400 slices a row
    python3 scripts/bench_nccl_slices.py --latency-us 1000   # a 1 ms operation: the cap it sets
    python3 scripts/bench_nccl_slices.py --json out.json

The fake group (`FakeLink`) does what torch's ProcessGroupNCCL does for pdserve: an operation
takes `--latency-us` once both ends have posted it and the one before it is done (NCCL runs a
pair's send and receive together, a pair's operations one after another), `is_completed()` says
so at once, and `wait(timeout)` polls it with a 1 ms sleep
between polls, as torch's WorkNCCL::wait does (kSynchronizeBusyWaitMillis = 1). Each side
spends `--work-us` per slice away from the group (the slice's digest with its `.item()`, its
descriptor on the control stream), in a sleep, as in two processes that never share a GIL.

Rows (each the rate of one channel, one sender thread and one receiver thread):
- `before`: what pdserve did until issue 46: one slice at a time, each side waiting with
  `wait(timeout)`: each slice costs each side at least 1 ms, whatever the link (~1000/s at
  most; the review estimated ~770/s on an H100 with the digests);
- `polled`: pdserve's PairGroup (`is_completed()` polled, yielding then backing off), one
  slice at a time;
- `polled` and `pipelined` run pdserve's own KvSender, NcclChannel and NcclReceiving.serve
  over the fake group (the receiver's inbox and checks left out), with a window of one slice,
  then nccl_transport.WINDOW slices in flight on each side.

What the rows say (docs/architecture.md, "The nccl transport"): the 1 ms floor is gone; one
slice at a time, a channel moves about 1 / (operation + the slower side's work) slices a second;
with slices in flight on both sides, 1 / max(operation, each side's work): the link is never
idle while a side checks a digest. The operation's time (bytes over the link's bandwidth plus
NCCL's ~10-20 us) is then the cap: 1000 slices/s for 1 ms operations, ~30 Llama-8B or ~12 70B
requests a second per channel (a slice is one layer of one request for one decode rank).

Plain torch; the fake group stands in for NCCL (the real one runs in scripts/gpu_check.py).
"""

import argparse
import json
import queue
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer.host_staging import Staged
from kv_transfer.nccl_transport import WINDOW, NcclChannel, NcclReceiving, PairGroup
from kv_transfer.transport import KvSender, LayerSlice

CPU = torch.device("cpu")
TORCH_POLL_S = 1e-3  # torch's WorkNCCL::wait(timeout) sleeps this long between polls


class FakeWork:
    """One posted operation: complete `latency` after its peer's was posted too."""

    def __init__(self, link: "FakeLink", kind: str, tensor: torch.Tensor) -> None:
        self.link = link
        self.kind = kind
        self.tensor = tensor
        self.done_at: float | None = None
        self.error: str | None = None
        self.timed_out = False  # torch records a timeout on the work (its watchdog acts on it)

    def is_completed(self) -> bool:
        return self.error is not None or (
            self.done_at is not None and time.monotonic() >= self.done_at
        )

    def wait(self, timeout: timedelta | None = None) -> bool:
        """torch's: with a timeout, poll with a 1 ms sleep between polls, record a timeout and
        raise at it; without one (NCCL), no wait on the host; raise what the work failed with."""
        if timeout is not None:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self.is_completed():
                if time.monotonic() > deadline:
                    self.timed_out = True
                    raise RuntimeError(f"fake {self.kind} timed out in blocking wait")
                time.sleep(TORCH_POLL_S)
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class FakeLink:
    """A fake 2-rank NCCL communicator: rank 0's sends meet rank 1's receives in order, and run
    one after another (NCCL runs a pair's operations on one stream), each `latency_s` long."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.free_at = 0.0  # when the operation running now ends
        self.lock = threading.Lock()
        self.sends: deque[FakeWork] = deque()
        self.recvs: deque[FakeWork] = deque()
        self.works: list[FakeWork] = []
        self.aborted = False
        self.timed_out_before_abort = False  # what torch's watchdog would have acted on

    def post(self, kind: str, tensor: torch.Tensor) -> FakeWork:
        work = FakeWork(self, kind, tensor)
        with self.lock:
            self.works.append(work)
            if self.aborted:
                work.error = "the communicator was aborted"
                return work
            (self.sends if kind == "send" else self.recvs).append(work)
            while self.sends and self.recvs:
                send, recv = self.sends.popleft(), self.recvs.popleft()
                recv.tensor.copy_(send.tensor)
                self.free_at = max(time.monotonic(), self.free_at) + self.latency_s
                send.done_at = recv.done_at = self.free_at
        return work

    def fail(self, why: str) -> None:
        """An error NCCL reports (a dead peer): every pending operation fails."""
        with self.lock:
            for work in [*self.sends, *self.recvs]:
                work.error = why
            self.sends.clear()
            self.recvs.clear()

    def abort(self) -> None:
        with self.lock:
            self.timed_out_before_abort = any(work.timed_out for work in self.works)
            self.aborted = True
        self.fail("the communicator was aborted")


class FakeBackend:
    """One rank's view of a FakeLink, with the calls PairGroup makes on a ProcessGroupNCCL."""

    def __init__(self, link: FakeLink) -> None:
        self.link = link

    def send(self, tensors, peer: int, tag: int) -> FakeWork:
        return self.link.post("send", tensors[0])

    def recv(self, tensors, peer: int, tag: int) -> FakeWork:
        return self.link.post("recv", tensors[0])

    def abort(self) -> None:
        self.link.abort()


class FakeCall:
    def __init__(self) -> None:
        self.ended = False

    def done(self) -> bool:
        return self.ended


class FakeStream:
    """The control stream: messages reach the receiver in order (`messages()`)."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self.call = FakeCall()

    def put(self, message) -> None:
        self.queue.put(message)

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.queue.put(wire.KvMessage(bye=True))
        self.queue.put(None)

    def messages(self):
        while (message := self.queue.get()) is not None:
            yield message


def pair(latency_s: float, timeout_s: float = 10.0) -> tuple[FakeLink, PairGroup, PairGroup]:
    """A fake link and pdserve's PairGroup over each of its ends."""
    link = FakeLink(latency_s)
    return (
        link,
        PairGroup.over(FakeBackend(link), 1, timeout_s),
        PairGroup.over(FakeBackend(link), 0, timeout_s),
    )


def slices(count: int, nbytes: int) -> list[LayerSlice]:
    """`count` slices of 32-layer transfers, each its own bytes, each counting its release."""
    made = []
    for i in range(count):
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        staged = Staged(data, nbytes, on_release=lambda tensor: None)
        made.append(LayerSlice(f"t-{i // 32}", i % 32, 0, 1, 0, 1, staged, i % 32 == 31, seq=i))
    return made


def receive(stream: FakeStream, group: PairGroup, work_s: float, received: list, window: int):
    """pdserve's NcclReceiving.serve over the stream (the receiver's room and checks left out);
    each slice delivered costs `work_s` (its digest checked, the inbox)."""

    def deliver(chunk, data) -> None:
        time.sleep(work_s)
        received.append((chunk, data))

    NcclReceiving.over(group, CPU, window).serve(
        stream.messages(),
        admit=lambda chunk: None,
        reserve=lambda size: None,
        unreserve=lambda size: None,
        buffer=bytearray,
        deliver=deliver,
    )


def rate_before(count: int, latency_s: float, work_s: float, nbytes: int = 4096) -> float:
    """Slices/s as pdserve sent them before: one at a time, `wait(timeout)` on each side."""
    link = FakeLink(latency_s)
    sender, receiver = FakeBackend(link), FakeBackend(link)
    timeout = timedelta(seconds=10)
    descriptors: queue.Queue = queue.Queue()
    data = torch.zeros(nbytes, dtype=torch.uint8)

    def receiving() -> None:
        for _ in range(count):
            descriptors.get()
            receiver.recv([torch.empty(nbytes, dtype=torch.uint8)], 0, 0).wait(timeout)
            time.sleep(work_s)

    thread = threading.Thread(target=receiving)
    started = time.perf_counter()
    thread.start()
    for _ in range(count):
        time.sleep(work_s)  # the digest, before the descriptor
        descriptors.put(1)
        sender.send([data], 1, 0).wait(timeout)
    thread.join()
    return count / (time.perf_counter() - started)


def rate_polled(count: int, latency_s: float, work_s: float, nbytes: int = 4096) -> float:
    """Slices/s through pdserve's PairGroup, one slice at a time (a window of 1)."""
    return rate_pipelined(count, latency_s, work_s, nbytes, window=1)


def rate_pipelined(
    count: int, latency_s: float, work_s: float, nbytes: int = 4096, window: int = WINDOW
) -> float:
    """Slices/s through pdserve's KvSender and NcclChannel (`window` slices in flight) to a
    receiver posting one receive at a time; every slice released once, every byte checked."""
    link, sending, receiving = pair(latency_s)
    stream = FakeStream()
    received: list = []
    sent = slices(count, nbytes)

    def opened(kind, destination):
        return NcclChannel.over(stream, sending, CPU, window)

    sender = KvSender(opened, lambda *cancel: None, integrity=False)
    original = sender._sealed
    sender._sealed = lambda piece: (time.sleep(work_s), original(piece))[1]  # the digest
    thread = threading.Thread(
        target=receive, args=(stream, receiving, work_s, received, window), daemon=True
    )
    thread.start()
    started = time.perf_counter()
    for piece in sent:
        sender.send("fake:1", "nccl", piece)
    while len(received) < count:
        if not thread.is_alive():
            raise RuntimeError("the receiver stopped")
        time.sleep(1e-4)
    took = time.perf_counter() - started
    sender.close()
    thread.join(timeout=5)
    if link.timed_out_before_abort or any(work.error for work in link.works):
        raise RuntimeError("an operation failed")
    if [chunk.seq for chunk, _ in received] != [piece.seq for piece in sent] or any(
        bytes(data) != piece.data.ready().numpy().tobytes()
        for (_, data), piece in zip(received, sent, strict=True)
    ):
        raise RuntimeError("slices arrived changed or out of order")
    if any(piece.data.on_release is not None for piece in sent):
        raise RuntimeError("a staged slice was never released")
    return count / took


def table(count: int, latency_us: float, work_us: float, nbytes: int) -> list[dict]:
    latency_s, work_s = latency_us / 1e6, work_us / 1e6
    rows = []
    for name, run in (
        ("before: wait(timeout), one at a time", rate_before),
        ("polled, one at a time", rate_polled),
        (f"pipelined, window {WINDOW}", rate_pipelined),
    ):
        rate = run(count, latency_s, work_s, nbytes)
        rows.append({"row": name, "slices_per_s": round(rate), "ms_per_slice": 1e3 / rate})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=400)
    parser.add_argument("--latency-us", type=float, default=20.0, help="an operation, both posted")
    parser.add_argument("--work-us", type=float, default=100.0, help="per slice, on each side")
    parser.add_argument("--bytes", type=int, default=4096, help="a slice's (copied by the fake)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = table(args.slices, args.latency_us, args.work_us, args.bytes)
    print(
        f"one nccl channel, fake group: {args.latency_us:g} us an operation, "
        f"{args.work_us:g} us of work per slice on each side, {args.slices} slices"
    )
    print(f"{'how':<40} {'slices/s':>9} {'ms/slice':>9}")
    for row in rows:
        print(f"{row['row']:<40} {row['slices_per_s']:>9} {row['ms_per_slice']:>9.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
