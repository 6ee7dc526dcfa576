"""The decode worker's KV loader (worker side, one per tensor-parallel rank).

Slices arrive on the transport receiver's threads; each engine step, on vLLM's thread, they are
copied into the KV cache blocks the scheduler reserved. A transfer is reported once: loaded when
every layer is in; failed when it passed its deadline or was cancelled (vLLM then recomputes or
fails the request, per `kv_load_failure_policy`); loaded too when its request was aborted, so
vLLM frees the blocks. Slices or cancels that come before their request are kept as orphans for
ORPHAN_TTL_S, then dropped.
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.grpc_transport import LayerSlice
from kv_transfer.metadata import Expected

log = logging.getLogger("pdserve.kv")
ORPHAN_TTL_S = 120.0  # slices or cancels for a transfer no request expects: dropped after


@dataclass
class Incoming:
    expected: Expected
    deadline: float
    layers_done: set[int] = field(default_factory=set)
    bytes: int = 0
    first_slice_at: float | None = None
    last_slice_at: float = 0.0


class KvLoader:
    def __init__(self, receiver, clock=time.monotonic) -> None:
        self.receiver = receiver  # take() -> (complete slices, {transfer id: cancel reason})
        self.clock = clock
        self.kv_caches: list[torch.Tensor] = []  # by layer index
        self.incoming: dict[str, Incoming] = {}  # transfer id -> state
        self.orphans: dict[str, list[LayerSlice]] = {}
        self.cancelled: dict[str, tuple[float, str]] = {}  # transfer id -> (when, why)
        self.finished: list[dict] = []  # per-transfer figures not yet reported

    def transfer_results(
        self, expected: list[Expected], finished_req_ids: set[str]
    ) -> tuple[set[str], set[str]]:
        """(loaded request ids, failed request ids); failed ones are in both sets."""
        now = self.clock()
        for entry in expected:
            self.incoming[entry.transfer_id] = Incoming(entry, now + entry.timeout_s)
            for piece in self.orphans.pop(entry.transfer_id, []):
                self._load(piece)
        complete, cancelled = self.receiver.take()
        self.cancelled.update((transfer_id, (now, why)) for transfer_id, why in cancelled.items())
        for piece in complete:
            if piece.transfer_id in self.incoming:
                self._load(piece)
            else:
                self.orphans.setdefault(piece.transfer_id, []).append(piece)
        self._drop_old_orphans(now)

        loaded, failed = set(), set()
        for transfer_id, state in list(self.incoming.items()):
            req_id = state.expected.req_id
            if req_id in finished_req_ids:  # aborted while loading
                loaded.add(req_id)
            elif len(state.layers_done) == len(self.kv_caches):
                loaded.add(req_id)
            elif transfer_id in self.cancelled or now > state.deadline:
                why = self.cancelled.pop(transfer_id, (now, None))[1] or (
                    f"no KV after {state.expected.timeout_s:g} s"
                )
                log.warning("KV transfer %s failed: %s", transfer_id, why)
                failed.add(req_id)
            else:
                continue
            self._record(transfer_id, state, failed=req_id in failed, now=now)
            del self.incoming[transfer_id]
        # Each request is reported once: its state is gone now (vLLM asserts on repeats).
        return loaded | failed, failed

    def _record(self, transfer_id: str, state: Incoming, failed: bool, now: float) -> None:
        """Transfer time: first slice received -> last slice received (when the transfer
        completed; `now` when it failed)."""
        if state.first_slice_at is None:
            started = ended = now
        else:
            started, ended = state.first_slice_at, now if failed else state.last_slice_at
        self.finished.append(
            {
                "transfer_id": transfer_id,
                "bytes": state.bytes,
                "seconds": ended - started,
                "failed": failed,
            }
        )

    def take_stats(self) -> list[dict]:
        finished, self.finished = self.finished, []
        return finished

    def _load(self, piece: LayerSlice) -> None:
        state = self.incoming[piece.transfer_id]
        if state.first_slice_at is None:
            state.first_slice_at = piece.received_at
        state.last_slice_at = max(state.last_slice_at, piece.received_at)
        state.bytes += len(piece.data)
        expected = state.expected
        cache = self.kv_caches[piece.layer]
        data = torch.frombuffer(piece.data, dtype=cache.dtype)
        data = data.view(piece.num_blocks, *cache.shape[1:])
        first, skip = piece.first_block, expected.skip_blocks
        targets = expected.block_ids[first : first + piece.num_blocks]
        keep = [i for i in range(len(targets)) if first + i >= skip]
        if keep:
            index = torch.tensor([targets[i] for i in keep], dtype=torch.long)
            cache.index_copy_(0, index, data[keep] if len(keep) < len(targets) else data)
        if piece.last:
            state.layers_done.add(piece.layer)

    def _drop_old_orphans(self, now: float) -> None:
        """Slices and cancels for transfers no request here expects (any more) are kept a
        while, as they may come before the request, then dropped."""
        for transfer_id in [
            t for t, pieces in self.orphans.items() if now - pieces[0].received_at > ORPHAN_TTL_S
        ]:
            log.warning("dropping KV for transfer %s: no request expected it", transfer_id)
            del self.orphans[transfer_id]
        for transfer_id in [
            t for t, (when, _) in self.cancelled.items() if now - when > ORPHAN_TTL_S
        ]:
            del self.cancelled[transfer_id]
