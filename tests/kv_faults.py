"""KV fault injection, for tests only: a channel wrapper that damages a fraction RATE of the
slices a prefill rank sends, the way a faulty network, driver or buggy sender would, so tests
prove the receiver catches each kind (kv_transfer/integrity.py) and the request still ends with
the right tokens (recomputed) or a clean error.

Kinds: corrupt (flip one bit), truncate (drop the second half of the bytes), duplicate (send
the slice twice), reorder (send the next slice first), stale (before a transfer's first slice,
send one kept from the transfer before it on the channel, as one left over after a cancel,
retry or migration would be, under this transfer's name), delay (wait DELAY_S before sending).

In one process, `faulty(open_channel, fault_for)` wraps a channel opener. A running worker gets
it through kv_transfer/channels.py's testing seam: `injectable_environment(folder)` names
`from_fault_file` there and a file in `folder`; `set_fault(folder, "KIND:RATE")` writes the
fault that the transfers started from then on get (the file is read at each transfer's first
slice), so a test changes it without restarting the engine.
"""

import os
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import torch

from kv_transfer.channels import CHANNEL_WRAPPER_ENV
from kv_transfer.host_staging import Staged
from kv_transfer.transport import Channel, LayerSlice, OpenChannel

FAULT_FILE_ENV = "PDSERVE_TEST_KV_FAULT_FILE"
DELAY_S = 0.05  # what a delayed slice waits
REORDER_WAIT_S = 1.0  # longest a reordered slice waits for the next one (then goes alone)
MAX_TRANSFERS = 1024  # transfers whose fault a channel remembers (the oldest are forgotten)


class KvFaultKind(StrEnum):
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    STALE = "stale"
    DELAY = "delay"


@dataclass(frozen=True)
class KvFault:
    kind: KvFaultKind
    rate: float  # the fraction of slices it hits, in [0, 1]


def parse_kv_fault(text: str) -> KvFault | None:
    """ "KIND:RATE" -> a KvFault; "" -> None; ValueError saying what is wrong."""
    if not text:
        return None
    kind, _, rate = text.partition(":")
    if kind not in set(KvFaultKind):
        raise ValueError(f"{text!r}: KIND must be one of {', '.join(KvFaultKind)}")
    try:
        value = float(rate)
    except ValueError:
        raise ValueError(f"{text!r}: RATE must be a number from 0 to 1") from None
    if not 0 <= value <= 1:
        raise ValueError(f"{text!r}: RATE must be from 0 to 1")
    return KvFault(KvFaultKind(kind), value)


FaultFor = Callable[[str], KvFault | None]  # a transfer id -> the fault its slices get


class FaultyChannel:
    """One channel whose slices get their transfer's fault. It is pipelined whatever it wraps
    (`done` gives back each slice the sender handed it, once through, and nothing it added),
    so a slice held back for a reorder keeps its staged buffer until it is sent."""

    def __init__(self, inner: Channel, fault_for: FaultFor, chance: Callable[[], float]) -> None:
        self.inner = inner
        self.fault_for = fault_for
        self.chance = chance
        self.inner_pipelined = callable(getattr(inner, "done", None))
        self.keep_idle = bool(getattr(inner, "keep_idle", False))
        self.faults: OrderedDict[str, KvFault | None] = OrderedDict()  # transfer id -> fault
        self.previous: LayerSlice | None = None  # stale: a transfer's first slice, bytes copied
        self.held: LayerSlice | None = None  # reorder: sent after the next slice
        self.held_since = 0.0
        # What each of the inner channel's sends in flight stands for (None: one a fault added).
        self.counted: deque[LayerSlice | None] = deque()
        self.through: list[LayerSlice] = []  # the sender's slices through, not yet given back

    def send(self, piece: LayerSlice) -> None:
        if self.held is not None:  # the slice a reorder sends first
            held, self.held = self.held, None
            self._send(piece, piece)
            self._send(held, held)
            return
        first = piece.transfer_id not in self.faults
        if first:
            self.faults[piece.transfer_id] = self.fault_for(piece.transfer_id)
            while len(self.faults) > MAX_TRANSFERS:
                self.faults.popitem(last=False)
        fault = self.faults[piece.transfer_id]
        kind = fault.kind if fault is not None and self.chance() < fault.rate else None
        if kind == KvFaultKind.STALE and first and self.previous is not None:
            stale = replace(
                self.previous,
                transfer_id=piece.transfer_id,
                layer=piece.layer,
                first_block=piece.first_block,
                first_head=piece.first_head,
                seq=piece.seq,
                last=False,
            )
            self._send(stale, None)
        if first and fault is not None and fault.kind == KvFaultKind.STALE:
            self.previous = replace(piece, data=_copy(piece.data.ready()))
        if kind == KvFaultKind.DELAY:
            time.sleep(DELAY_S)
        if kind == KvFaultKind.CORRUPT:
            self._send(replace(piece, data=_flipped(piece.data.ready(), self.chance)), piece)
        elif kind == KvFaultKind.TRUNCATE:
            data = piece.data.ready()
            half = data.numel() // 2
            self._send(replace(piece, data=Staged(data[:half], half)), piece)
        elif kind == KvFaultKind.DUPLICATE:
            self._send(piece, piece)
            self._send(piece, None)
        elif kind == KvFaultKind.REORDER:
            self.held, self.held_since = piece, time.monotonic()
        else:
            self._send(piece, piece)

    def _send(self, out: LayerSlice, stands_for: LayerSlice | None) -> None:
        """Send `out`; once it is through, `done` gives back `stands_for`: the sender's slice
        it is (maybe damaged), or None for one the fault added."""
        self.inner.send(out)
        if self.inner_pipelined:
            self.counted.append(stands_for)
        elif stands_for is not None:
            self.through.append(stands_for)

    def done(self, wait: bool) -> list[LayerSlice]:
        if self.held is not None and (wait or time.monotonic() - self.held_since > REORDER_WAIT_S):
            held, self.held = self.held, None
            self._send(held, held)
        if self.inner_pipelined:
            for _ in self.inner.done(wait):
                counted = self.counted.popleft()
                if counted is not None:
                    self.through.append(counted)
        through, self.through = self.through, []
        return through

    def alive(self) -> bool:
        return self.inner.alive()

    def close(self) -> None:
        self.inner.close()


def faulty(
    open_channel: OpenChannel, fault_for: FaultFor, chance: Callable[[], float] = random.random
) -> OpenChannel:
    """`open_channel` whose channels give each transfer's slices `fault_for(transfer_id)`
    (asked once per transfer and channel, at its first slice)."""

    def open_faulty(kind, destination) -> Channel:
        return FaultyChannel(open_channel(kind, destination), fault_for, chance)

    return open_faulty


def from_fault_file(open_channel: OpenChannel) -> OpenChannel:
    """What CHANNEL_WRAPPER_ENV names in a running worker: each transfer gets the fault the file
    FAULT_FILE_ENV names holds when its first slice is sent (none while it is absent)."""
    path = Path(os.environ[FAULT_FILE_ENV])

    def fault_for(transfer_id: str) -> KvFault | None:
        try:
            return parse_kv_fault(path.read_text().strip())
        except FileNotFoundError:
            return None

    return faulty(open_channel, fault_for)


def fault_file(folder: Path) -> Path:
    return folder / "kv-fault"


def injectable_environment(folder: Path) -> dict[str, str]:
    """The environment a cluster's workers need for `set_fault(folder, ...)` to reach them:
    this wrapper, its file, and this checkout on the path of every process they start."""
    checkout = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH", "")) if p)
    return {
        CHANNEL_WRAPPER_ENV: f"{__name__}:{from_fault_file.__name__}",
        FAULT_FILE_ENV: str(fault_file(folder)),
        "PYTHONPATH": path,
    }


def set_fault(folder: Path, fault: str) -> None:
    """The fault ("KIND:RATE", "" for none) the transfers started from now on get, in every
    worker started with `injectable_environment(folder)` (written whole: a reader never sees
    half of it)."""
    parse_kv_fault(fault)
    path = fault_file(folder)
    written = path.with_suffix(".new")
    written.write_text(fault)
    os.replace(written, path)


def _copy(data: torch.Tensor) -> Staged:
    copy = data.clone()
    return Staged(copy, copy.numel())


def _flipped(data: torch.Tensor, chance: Callable[[], float]) -> Staged:
    """A copy of `data` with one bit flipped (the staged original is left alone)."""
    copy = data.clone()
    if copy.numel():
        at = min(int(chance() * copy.numel()), copy.numel() - 1)
        copy[at] ^= 1 << min(int(chance() * 8), 7)
    return Staged(copy, copy.numel())
