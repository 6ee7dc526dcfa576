"""The decode worker's KV loader (worker side, one per tensor-parallel rank).

Slices arrive on the transport receiver's threads; each engine step, on vLLM's thread, they are
copied into the KV cache blocks the scheduler reserved, into this rank's heads: before the
step's forward pass for a transfer the scheduler half loads in the step that schedules its
request (`load_now`: its KV had all arrived; a transfer not whole and sound then is reported as
load errors, never computed from), else after it, each transfer reported once its outcome is
known (`transfer_results`). On CUDA those
copies are queued on a side stream and vLLM's thread never waits for them (pinned receive
buffers and indexes, asynchronous copies, kv_transfer/host_staging.HostToDevice): a transfer
whose outcome is known is reported in the first engine step in which an event recorded after
its last copy has passed (an event query), so its blocks are not scheduled, reused or
recomputed while a copy into them is still queued. With the prefill pool at
another tensor-parallel size a layer arrives in several slices, one per prefill rank routed to
this rank (kv_transfer/head_shards.py). A transfer is reported once: loaded when every slice of
every layer is in; failed when it passed its deadline or was cancelled, or its sender's
handshake was refused (vLLM then recomputes or fails the request, per `kv_load_failure_policy`);
loaded too when its request was aborted, so vLLM frees the blocks. Slices or cancels that come
before their request are kept as orphans for ORPHAN_TTL_S, then dropped; a cancel frees its
transfer's orphan slices at once (and drops any that come after it): the router cancels a
transfer whose decode leg will not run, and its KV must not hold the inbox meanwhile.

Integrity (kv_transfer/integrity.py): before a slice is copied into the cache it must belong to
this reservation (its epoch), come after every slice its sender sent before it (its sequence
number: no duplicate, no reordering), have the size its blocks and heads need, and its bytes
must have matched their digest where they landed (the receiving thread checked that). A slice
that fails any of these is not loaded and fails its whole transfer (reported as an `integrity`
failure, so vLLM applies the policy): never a token computed from wrong KV.
"""

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from kv_transfer.head_shards import head_routes, rank_heads
from kv_transfer.host_staging import HostToDevice
from kv_transfer.integrity import Damage, transfer_epoch
from kv_transfer.kv_copy import first_of_run, from_bytes, scatter, wire_shape, write_run
from kv_transfer.kv_layout import LayerLayout
from kv_transfer.memory_budget import INBOX_BYTES
from kv_transfer.metadata import Expected
from kv_transfer.transfer_report import Cancel, Failure, TransferReport
from kv_transfer.transport import LayerSlice, nbytes

log = logging.getLogger("pdserve.kv")
ORPHAN_TTL_S = 120.0  # slices or cancels for a transfer no request expects: dropped after


@dataclass(frozen=True)
class Outcome:
    failure: Failure | None = None  # None: loaded (or its request aborted: vLLM frees the blocks)


LOADED = Outcome()


@dataclass
class Incoming:
    expected: Expected
    deadline: float
    slices_per_layer: int  # senders routed to this rank, each ending a layer with a last slice
    last_slices: dict[int, int] = field(default_factory=dict)  # layer -> last slices received
    bytes: int = 0
    transports: set[str] = field(default_factory=set)  # what carried its slices
    first_slice_at: float | None = None
    last_slice_at: float = 0.0
    last_seq: dict[int, int] = field(default_factory=dict)  # first head -> sequence number
    damage: Damage | None = None  # what failed its integrity check, once one was found
    outcome: Outcome | None = None  # once known
    landed: object = None  # HostToDevice.mark() taken when the outcome was known


class KvLoader:
    def __init__(
        self,
        receiver,
        kv_caches: list[torch.Tensor],
        layout: LayerLayout,
        head_size: int,
        total_heads: int,
        tp: int = 1,
        rank: int = 0,
        clock=time.monotonic,
        integrity: bool = True,
    ) -> None:
        self.receiver = receiver  # take() -> (complete slices, {transfer id: Cancel})
        self.integrity = integrity  # check each slice's epoch and sequence number
        self.clock = clock
        self.caches = [layout.canonical(cache, head_size) for cache in kv_caches]  # by layer
        self.head_size = head_size
        self.kv_size = layout.kv_size
        self.total_heads = total_heads
        self.tp = tp
        self.rank = rank
        self.own_heads = rank_heads(total_heads, tp, rank)
        inbox = getattr(receiver, "inbox", receiver)  # a KvReceiver's, or an Inbox itself
        self.staging = HostToDevice(
            kv_caches[0].device, receive_bytes=getattr(inbox, "max_bytes", INBOX_BYTES)
        )
        if hasattr(inbox, "free_buffer"):  # its receive buffers go back to the pinned arena
            inbox.free_buffer = self.staging.free_receive_buffer
        self.incoming: dict[str, Incoming] = {}  # transfer id -> state
        self.orphans: dict[str, list[LayerSlice]] = {}
        self.cancelled: dict[str, tuple[float, Cancel]] = {}  # transfer id -> (when, cancel)
        self.ended: dict[str, float] = {}  # transfers reported (when): later slices are dropped
        self.finished: list[TransferReport] = []  # not yet taken
        self.load_errors: set[int] = set()  # blocks load_now could not fill, not yet taken

    def transfer_results(
        self, expected: list[Expected], finished_req_ids: set[str]
    ) -> tuple[set[str], set[str]]:
        """(loaded request ids, failed request ids); failed ones are in both sets."""
        now = self.clock()
        self._expect(expected, now)
        self._take(now)
        loaded, failed = set(), set()
        for transfer_id, state in list(self.incoming.items()):
            if state.outcome is None:
                state.outcome = self._outcome(transfer_id, state, finished_req_ids, now)
                if state.outcome is None:
                    continue
                self._record(transfer_id, state, state.outcome.failure, now=now)
                state.landed = self.staging.mark()
            elif state.expected.req_id in finished_req_ids:  # aborted while its copies land
                state.outcome = LOADED  # reported as an aborted one is: vLLM frees the blocks
            if not self.staging.passed(state.landed):  # a copy into its blocks is queued
                continue
            (loaded if state.outcome.failure is None else failed).add(state.expected.req_id)
            del self.incoming[transfer_id]
            self.ended[transfer_id] = now
        self.staging.collect()  # slices whose copies the side stream has passed
        # Each request is reported once: its state is gone now (vLLM asserts on repeats).
        return loaded | failed, failed

    def load_now(self, loads: list[Expected]) -> None:
        """Transfers whose requests this engine step schedules (the scheduler half learned that
        every rank held their KV: decode_workers/arrivals.py), loaded before its forward pass.
        On CUDA the copies go on the side stream and the forward stream waits for it there (a
        GPU-side wait, never vLLM's thread). A transfer not whole and sound here (a slice failed
        its check, or is missing) has its blocks past the skipped prefix reported as load errors
        (`take_load_errors`), so vLLM recomputes or fails the request (`kv_load_failure_policy`)
        and drops what this step computed from them."""
        if not loads:
            return
        now = self.clock()
        self._expect(loads, now)
        self._take(now)
        for entry in loads:
            state = self.incoming.pop(entry.transfer_id)
            self.ended[entry.transfer_id] = now
            failure = self._failure_now(entry.transfer_id, state)
            if failure is not None:
                self.load_errors.update(entry.block_ids[entry.skip_blocks :])
            self._record(entry.transfer_id, state, failure, now=now, in_step=True)
        self.staging.precede_forward()

    def _failure_now(self, transfer_id: str, state: Incoming) -> Failure | None:
        """Why a transfer loaded in its request's step cannot be used, None when it can."""
        if state.damage is not None:
            return Failure.INTEGRITY
        if self._complete(state):
            return None
        cancelled = self.cancelled.pop(transfer_id, None)
        failure = cancelled[1].failure if cancelled else Failure.TIMEOUT
        log.warning(
            "KV transfer %s (request %s) was not whole when its request was scheduled (%s): "
            "rank %d had %d bytes, last slices %s of %d per layer; the worker's "
            "kv_failure_policy applies",
            transfer_id,
            state.expected.req_id,
            failure,
            self.rank,
            state.bytes,
            state.last_slices,
            state.slices_per_layer,
        )
        return failure

    def take_load_errors(self) -> set[int]:
        """Blocks `load_now` could not fill since the last call (vLLM's
        get_block_ids_with_load_errors)."""
        errors, self.load_errors = self.load_errors, set()
        return errors

    def _expect(self, entries: list[Expected], now: float) -> None:
        """Reservations the scheduler made: what came for them before is loaded now."""
        for entry in entries:
            senders = sum(
                route.decode_rank == self.rank
                for route in head_routes(self.total_heads, entry.prefill_tp, self.tp)
            )
            self.incoming[entry.transfer_id] = Incoming(entry, now + entry.timeout_s, senders)
            for piece in self.orphans.pop(entry.transfer_id, []):
                self._load(piece)

    def _take(self, now: float) -> None:
        """What the receiver holds: loaded when expected, dropped when it ended, kept as an
        orphan otherwise."""
        complete, cancelled = self.receiver.take()
        self.cancelled.update((transfer_id, (now, c)) for transfer_id, c in cancelled.items())
        for transfer_id in cancelled:
            if transfer_id not in self.incoming:
                self._drop_cancelled(transfer_id, now)
        for piece in complete:
            if piece.transfer_id in self.incoming:
                self._load(piece)
            elif piece.transfer_id in self.ended:  # aborted or failed: nothing waits for it
                piece.release()
            else:
                self.orphans.setdefault(piece.transfer_id, []).append(piece)
        self._drop_old_orphans(now)

    def _outcome(
        self, transfer_id: str, state: Incoming, finished_req_ids: set[str], now: float
    ) -> Outcome | None:
        """How the transfer ended, None while it is still coming."""
        if state.expected.req_id in finished_req_ids:  # aborted while loading
            return LOADED
        if state.damage is not None:
            return Outcome(Failure.INTEGRITY)
        if self._complete(state):
            return LOADED
        if transfer_id in self.cancelled or now > state.deadline:
            timeout = Cancel(Failure.TIMEOUT, f"no KV after {state.expected.timeout_s:g} s")
            _, ended = self.cancelled.pop(transfer_id, (now, timeout))
            log.warning(
                "KV transfer %s failed (%s): %s; rank %d had %d bytes, last slices %s of %d "
                "per layer, orphans %s",
                transfer_id,
                ended.failure,
                ended.reason,
                self.rank,
                state.bytes,
                state.last_slices,
                state.slices_per_layer,
                sorted(self.orphans),
            )
            return Outcome(ended.failure)
        return None

    def abandon(self, transfer_ids: list[str]) -> None:
        """Transfers whose requests this worker computes itself (the prefill worker skipped
        blocks this worker no longer holds: decode_workers/load_plan.py): what came for them is
        freed, what comes is dropped, and each is reported failed (by every rank, as every
        transfer is: pdserve/worker/engine_stats.py merges the ranks' reports)."""
        now = self.clock()
        for transfer_id in transfer_ids:
            for piece in self.orphans.pop(transfer_id, []):
                piece.release()
            self.ended[transfer_id] = now
            self._report(TransferReport(transfer_id, failure=Failure.NOT_HELD))

    def _complete(self, state: Incoming) -> bool:
        return len(state.last_slices) == len(self.caches) and all(
            count >= state.slices_per_layer for count in state.last_slices.values()
        )

    def _record(
        self,
        transfer_id: str,
        state: Incoming,
        failure: Failure | None,
        now: float,
        in_step: bool = False,
    ) -> None:
        """Transfer time: first slice received -> last slice received (when the transfer
        completed; `now` when it failed). `in_step`: loaded in its request's step."""
        if state.first_slice_at is None:
            started = ended = now
        else:
            started, ended = state.first_slice_at, now if failure else state.last_slice_at
        self._report(
            TransferReport(
                transfer_id,
                state.bytes,
                ended - started,
                failure,
                state.damage,
                frozenset(state.transports),
                in_step=in_step,
            )
        )

    def _report(self, report: TransferReport) -> None:
        """A finished transfer's report, for take_reports; beside CUDA with the rank's pinned
        receive memory then (the inbox's size once the first slice came, more only if a buffer
        had to be pinned beside it)."""
        if self.staging.pin:
            report = replace(report, pinned_bytes=self.staging.pinned_stats()["pinned_bytes"])
        self.finished.append(report)

    def take_reports(self) -> list[TransferReport]:
        finished, self.finished = self.finished, []
        return finished

    def _load(self, piece: LayerSlice) -> None:
        """Copy the slice into the cache, then free its room in the receiver's inbox once the
        copy has read it (on CUDA: once the side stream has passed it)."""
        try:
            self._copy(piece)
        finally:
            self.staging.release_after(piece.release)

    def _copy(self, piece: LayerSlice) -> None:
        state = self.incoming[piece.transfer_id]
        if state.damage is not None or state.outcome is not None:  # failed or ended
            return
        cache = self.caches[piece.layer] if piece.layer < len(self.caches) else None
        damage = self._damage(piece, state, cache)
        if damage is not None:
            state.damage = damage
            state.transports.add(piece.transport)
            log.error(
                "KV transfer %s (request %s) failed its integrity check: %s slice (layer %d, "
                "blocks %d+%d, heads %d+%d, seq %d, via %s): the transfer fails and the "
                "worker's kv_failure_policy applies",
                piece.transfer_id,
                state.expected.req_id,
                damage,
                piece.layer,
                piece.first_block,
                piece.num_blocks,
                piece.first_head,
                piece.num_heads,
                piece.seq,
                piece.transport,
            )
            return
        if state.first_slice_at is None:
            state.first_slice_at = piece.received_at
        state.last_slice_at = max(state.last_slice_at, piece.received_at)
        state.bytes += nbytes(piece.data)
        state.transports.add(piece.transport)
        local = piece.first_head - self.own_heads.start
        if local < 0 or local + piece.num_heads > len(self.own_heads):
            log.error(
                "KV transfer %s: heads %d+%d are not this rank's (%s); slice dropped",
                piece.transfer_id,
                piece.first_head,
                piece.num_heads,
                self.own_heads,
            )
            return
        block_size = cache.shape[2]
        wire = from_bytes(
            piece.data,
            cache.dtype,
            wire_shape(piece.num_blocks, piece.num_heads, block_size, self.head_size, self.kv_size),
        )
        expected = state.expected
        first, skip = piece.first_block, expected.skip_blocks
        targets = expected.block_ids[first : first + piece.num_blocks]
        start = max(skip - first, 0)  # blocks before `skip` are this worker's own prefix hit
        if start < len(targets):
            rows = wire[start : len(targets)]  # a view: still in the (pinned) receive buffer
            heads = slice(local, local + piece.num_heads)
            blocks = targets[start:]
            run = first_of_run(blocks)
            if run is None:  # an index only where the copy is indexed
                index = self.staging.index(blocks)
                self.staging.load(rows, index, lambda r, i: scatter(r, cache, i, heads))
            else:
                self.staging.load(rows, None, lambda r, _: write_run(r, cache, run, heads))
        if piece.last:
            state.last_slices[piece.layer] = state.last_slices.get(piece.layer, 0) + 1

    def _damage(self, piece: LayerSlice, state: Incoming, cache) -> Damage | None:
        """What is wrong with the slice for this reservation, if anything."""
        if self.integrity:
            if piece.epoch != transfer_epoch(piece.transfer_id):
                return Damage.STALE
            last = state.last_seq.get(piece.first_head, -1)
            if piece.seq <= last:
                return Damage.DUPLICATE if piece.seq == last else Damage.ORDER
            state.last_seq[piece.first_head] = piece.seq
        if cache is None or nbytes(piece.data) != (
            piece.num_blocks * piece.num_heads * cache[0, 0].numel() * cache.element_size()
        ):
            return Damage.LENGTH
        return piece.damage or None  # the receiving thread's digest check

    def _drop_cancelled(self, transfer_id: str, now: float) -> None:
        """A transfer cancelled before any request here expected it (its decode leg will not
        run, or its sender failed): what came for it is freed now, what comes is dropped, and
        the cancel is kept (a request that does come for it fails at once). Its KV would
        otherwise hold the inbox, which every other transfer needs, for ORPHAN_TTL_S."""
        pieces = self.orphans.pop(transfer_id, [])
        for piece in pieces:
            piece.release()
        if pieces:
            log.info(
                "KV transfer %s cancelled before its request came: %d slices freed",
                transfer_id,
                len(pieces),
            )
        self.ended.setdefault(transfer_id, now)

    def _drop_old_orphans(self, now: float) -> None:
        """Slices and cancels for transfers no request here expects (any more) are kept a
        while, as they may come before the request, then dropped."""
        for transfer_id in [
            t for t, pieces in self.orphans.items() if now - pieces[0].received_at > ORPHAN_TTL_S
        ]:
            log.warning("dropping KV for transfer %s: no request expected it", transfer_id)
            for piece in self.orphans.pop(transfer_id):
                piece.release()
        for transfer_id in [
            t for t, (when, _) in self.cancelled.items() if now - when > ORPHAN_TTL_S
        ]:
            del self.cancelled[transfer_id]
        for transfer_id in [t for t, when in self.ended.items() if now - when > ORPHAN_TTL_S]:
            del self.ended[transfer_id]
