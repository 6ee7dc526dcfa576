"""Fault injection for tests (`--kv-fault KIND:RATE`, off by default): the sending transport
damages a fraction RATE of the slices it sends, the way a faulty network, driver or buggy
sender would, so tests can prove the receiver catches each kind (kv_transfer/integrity.py) and
the request still ends with the right tokens (recomputed) or a clean error.

Kinds: corrupt (flip one bit), truncate (drop the second half of the bytes), duplicate (send
the slice twice), reorder (send the next slice first), stale (before a transfer's first slice,
send one kept from the transfer before it, as one left over after a cancel, retry or migration
would be, under this transfer's name), delay (wait DELAY_S before sending). A testing aid:
never set it in production.
"""

import functools
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from kv_transfer.host_staging import Staged
from pdserve.core.kv_faults import KvFaultKind, parse_kv_fault

log = logging.getLogger("pdserve.kv")

DELAY_S = 0.05  # what a delayed slice waits


_parsed = functools.lru_cache(maxsize=64)(parse_kv_fault)  # each slice names its fault


class FaultInjector:
    """One sending thread's faults: `pieces(piece, take_next)` gives what to send in place of
    `piece` (each slice names its own fault, so a test can change it per transfer);
    `take_next()` gives the thread's next slice, or None (what `reorder` sends first)."""

    def __init__(self, chance: Callable[[], float] = random.random) -> None:
        self.chance = chance
        self.previous = None  # the first slice of the last transfer seen (stale), bytes copied

    def pieces(self, piece, take_next: Callable[[], object]) -> Iterator:
        fault = _parsed(piece.fault)
        kind = fault.kind if fault is not None and self.chance() < fault.rate else None
        if kind is not None:
            log.warning(
                "KV fault injected: %s on transfer %s layer %d",
                kind,
                piece.transfer_id,
                piece.layer,
            )
        new_transfer = self.previous is None or self.previous.transfer_id != piece.transfer_id
        if kind == KvFaultKind.STALE and self.previous is not None and new_transfer:
            yield replace(
                self.previous,
                transfer_id=piece.transfer_id,
                layer=piece.layer,
                first_block=piece.first_block,
                first_head=piece.first_head,
                seq=piece.seq,
                last=False,
            )
        if new_transfer and fault is not None and fault.kind == KvFaultKind.STALE:
            self.previous = replace(piece, data=_copy(piece.data.ready()))
        if kind == KvFaultKind.DELAY:
            time.sleep(DELAY_S)
        if kind == KvFaultKind.CORRUPT:
            yield replace(piece, data=_flipped(piece.data.ready(), self.chance))
        elif kind == KvFaultKind.TRUNCATE:
            data = piece.data.ready()
            yield replace(piece, data=Staged(data[: data.numel() // 2], data.numel() // 2))
        elif kind == KvFaultKind.DUPLICATE:
            yield piece
            yield piece
        elif kind == KvFaultKind.REORDER:
            later = take_next()
            if later is not None:
                yield later
            yield piece
        else:
            yield piece


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
