"""Which transfers' KV has wholly arrived at every rank of a decode engine: the worker ranks tell
the scheduler half, so it can load that KV in the step that schedules its request.

vLLM's scheduler half runs in the engine-core process and each rank's worker half in its own
worker process, so the scheduler cannot look into a rank's inbox. As slices land in a rank's
inbox (on the receiving threads), `ArrivalNotices` counts, per transfer and layer, the senders
whose last slice of the layer came; when every layer has one more, it sends the scheduler half a
datagram (`Arrived`) over an abstract Unix socket named after the engine (its KV engine id and
data-parallel rank: both processes read them from the same vLLM config). `ArrivalBoard`, the
scheduler half's end, reads what came without waiting whenever a request asks, and answers
whether every rank holds what every sender routed to it sent (kv_transfer/head_shards.py).

A notice is a hint: a slice that failed a check it can make here (digest, epoch, sequence)
stops its transfer's notices, and the KV loader checks every slice again when it loads it; a
lost or late notice only means the request takes the asynchronous path (a step later). Memory is
bounded: at most MAX_TRANSFERS transfers are counted (the oldest forgotten) and a notice older
than NOTICE_TTL_S is not believed (the loader keeps slices no request expected for longer:
decode_workers/kv_loader.ORPHAN_TTL_S). Only datagrams from this user's processes are read (the
kernel's credentials): an abstract socket is open to every process in the network namespace.
"""

import json
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

from kv_transfer.head_shards import head_routes
from kv_transfer.integrity import transfer_epoch
from kv_transfer.transport import LayerSlice

log = logging.getLogger("pdserve.kv")
MAX_TRANSFERS = 4096  # transfers counted (worker side) or remembered (scheduler side) at once
NOTICE_TTL_S = 60.0  # a notice older than this is not believed (half the loader's orphan TTL)
MAX_NOTICE_BYTES = 4096
_CREDENTIALS = struct.calcsize("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Arrived:
    """Rank `rank` holds the last slice of every layer of transfer `transfer_id` from
    `senders` senders (each sends its own heads: distinct first heads)."""

    transfer_id: str
    rank: int
    senders: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Arrived":
        fields = json.loads(data)
        return cls(str(fields["transfer_id"]), int(fields["rank"]), int(fields["senders"]))


def arrivals_address(engine_id: str, data_parallel_rank: int) -> str:
    """The scheduler half's abstract socket name for one engine."""
    return f"\0pdserve-kv-arrivals:{engine_id}:{data_parallel_rank}"


@dataclass
class _Counting:
    heads_done: dict[int, set[int]] = field(default_factory=dict)  # layer -> first heads ended
    last_seq: dict[int, int] = field(default_factory=dict)  # first head -> sequence number
    told: int = 0  # senders already announced
    spoiled: bool = False  # a slice failed a check: never announced


class ArrivalNotices:
    """Worker side: `landed(piece)` for each slice the rank's inbox takes (receiving threads)."""

    def __init__(self, address: str, rank: int, num_layers: int, integrity: bool = True) -> None:
        self.address = address
        self.rank = rank
        self.num_layers = num_layers
        self.integrity = integrity
        self.lock = threading.Lock()
        self.counting: OrderedDict[str, _Counting] = OrderedDict()
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.setblocking(False)

    def landed(self, piece: LayerSlice) -> None:
        with self.lock:
            senders = self._count(piece)
        if senders:
            self._send(Arrived(piece.transfer_id, self.rank, senders))

    def _count(self, piece: LayerSlice) -> int:
        """The senders to announce now (0: nothing new)."""
        state = self.counting.get(piece.transfer_id)
        if state is None:
            state = self.counting[piece.transfer_id] = _Counting()
            while len(self.counting) > MAX_TRANSFERS:
                self.counting.popitem(last=False)
        if state.spoiled or self._spoils(piece, state):
            state.spoiled = True
            return 0
        if piece.last:
            state.heads_done.setdefault(piece.layer, set()).add(piece.first_head)
        if len(state.heads_done) < self.num_layers:
            return 0
        senders = min(len(heads) for heads in state.heads_done.values())
        if senders <= state.told:
            return 0
        state.told = senders
        return senders

    def _spoils(self, piece: LayerSlice, state: _Counting) -> bool:
        """Whether the slice fails a check the loader will make (kv_loader.KvLoader._damage)."""
        if piece.damage:
            return True
        if not self.integrity:
            return False
        if piece.epoch != transfer_epoch(piece.transfer_id):
            return True
        if piece.seq <= state.last_seq.get(piece.first_head, -1):
            return True
        state.last_seq[piece.first_head] = piece.seq
        return False

    def _send(self, notice: Arrived) -> None:
        try:
            self.socket.sendto(notice.encode(), self.address)
        except OSError:  # no scheduler listening (yet), or its queue is full: a step later
            pass

    def close(self) -> None:
        self.socket.close()


class ArrivalBoard:
    """Scheduler side: what the engine's ranks announced; `arrived(transfer_id, prefill_tp)`."""

    def __init__(self, address: str, tp: int, total_heads: int, clock=time.monotonic) -> None:
        self.tp = tp
        self.total_heads = total_heads
        self.clock = clock
        self.notices: OrderedDict[str, dict[int, tuple[int, float]]] = OrderedDict()
        self.socket: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.socket.bind(address)
        except OSError as error:  # every load then takes the asynchronous path
            log.warning("KV arrivals socket %r: %s: KV loads a step later", address[1:], error)
            self.socket.close()
            self.socket = None
            return
        self.socket.setblocking(False)

    def arrived(self, transfer_id: str, prefill_tp: int) -> bool:
        """Whether every rank announced every sender routed to it (KV that came since counts)."""
        self._read()
        ranks = self.notices.get(transfer_id, {})
        now = self.clock()
        needed = [0] * self.tp
        try:
            routes = head_routes(self.total_heads, prefill_tp, self.tp)
        except ValueError:  # a sender no rank could load from: the loader reports it
            return False
        for route in routes:
            needed[route.decode_rank] += 1
        return all(
            rank in ranks and ranks[rank][0] >= count and now - ranks[rank][1] <= NOTICE_TTL_S
            for rank, count in enumerate(needed)
        )

    def _read(self) -> None:
        if self.socket is None:
            return
        uid = os.getuid()
        while True:
            try:
                data, ancillary, _, _ = self.socket.recvmsg(
                    MAX_NOTICE_BYTES, socket.CMSG_SPACE(_CREDENTIALS)
                )
            except (BlockingIOError, InterruptedError):
                return
            if not any(
                level == socket.SOL_SOCKET
                and kind == socket.SCM_CREDENTIALS
                and struct.unpack("3i", payload[:_CREDENTIALS])[1] == uid
                for level, kind, payload in ancillary
            ):
                continue  # another user's: not believed
            try:
                notice = Arrived.decode(data)
            except (ValueError, KeyError, TypeError):
                continue
            self._note(notice)

    def _note(self, notice: Arrived) -> None:
        ranks = self.notices.setdefault(notice.transfer_id, {})
        ranks[notice.rank] = (notice.senders, self.clock())
        self.notices.move_to_end(notice.transfer_id)
        while len(self.notices) > MAX_TRANSFERS:
            self.notices.popitem(last=False)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
