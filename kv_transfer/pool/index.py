"""The host KV pool's index: which block (by key) sits in which slot of the pool's memory, what
may be read, what is being written, and what goes when space is needed.

A slot holds one KV block of one engine layout (every key of one pool means the same tokens on
the same model and layout: the key is vLLM's chained block hash, namespaced by the pool). The
slot count is the byte budget divided by the slot size, so the pool never holds more than its
budget. A block is readable once its writer said it is complete; a block being written or read
(pinned) is never evicted. Eviction takes the least recently used block, but a block that was
read since it last came up gets another round (its reuse count goes down by one instead): recency
weighted by reuse, so a long system prompt read by every conversation outlives one-off blocks.

Owners: every pin and every write in progress belongs to the connection that took it, so a
client that dies (an engine killed mid-load) releases what it held (`release_owner`).

Contents: every block that becomes loadable or stops being loadable is logged with a sequence
number, so that routers can keep a copy of what the pool holds (`contents_since`: the changes
after a sequence number, or every loadable key when those changes are no longer all logged).

Plain Python, no I/O: pdserve's store process (kv_transfer/pool/store.py) holds one and serves
it to the workers of its host.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

MAX_REUSE = 3  # rounds a much-read block is spared: a once-hot block still goes, in time
# A reader further behind than the log gets the loadable keys instead, at most as many, the most
# recently used: one answer stays a few MB (a key is 36 bytes) whatever the pool's size.
MAX_LOGGED_CHANGES = 1 << 16


@dataclass
class Entry:
    slot: int
    ready: bool = False  # written and complete: loadable
    reuse: int = 0  # reads since it was last spared by an eviction
    pins: Counter = field(default_factory=Counter)  # owner -> reads in progress
    writer: int | None = None  # the owner writing it, until complete


@dataclass(frozen=True)
class Stored:
    """What `prepare_store` hands a writer: the keys it should write (those not already
    stored), their slots, and the keys evicted to make room."""

    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    evicted: tuple[bytes, ...]


@dataclass(frozen=True)
class Changes:
    """What `contents_since` answers: the change number now, and the keys that became
    loadable (`added`) or stopped being loadable (`removed`) since the reader's; `reset`: the
    reader's copy is replaced, by every loadable key (in `added`)."""

    sequence: int
    reset: bool
    added: tuple[bytes, ...]
    removed: tuple[bytes, ...]


class PoolIndex:
    def __init__(self, slots: int):
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self.hits = 0
        self.evictions = 0
        self.dropped = 0
        self.sequence = 0  # changes of what is loadable so far
        self._changes: deque[tuple[bytes, bool]] = deque(maxlen=MAX_LOGGED_CHANGES)

    @property
    def used(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are stored and readable."""
        found = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                break
            found += 1
        return found

    def prepare_load(self, keys: Sequence[bytes], owner: int) -> tuple[int, ...] | None:
        """Pins `keys` for `owner` and gives their slots; None (nothing pinned) if any is not
        readable any more."""
        entries = [self._entries.get(key) for key in keys]
        if any(entry is None or not entry.ready for entry in entries):
            return None
        for key, entry in zip(keys, entries, strict=True):
            entry.pins[owner] += 1
            entry.reuse = min(entry.reuse + 1, MAX_REUSE)
            self._entries.move_to_end(key)
        self.hits += len(keys)
        return tuple(entry.slot for entry in entries)

    def complete_load(self, keys: Sequence[bytes], owner: int) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins[owner] > 0:
                entry.pins[owner] -= 1
                if not entry.pins[owner]:
                    del entry.pins[owner]
                if not entry.ready and self._evictable(entry):  # dropped while it was read
                    self._remove(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def prepare_store(self, keys: Sequence[bytes], owner: int) -> Stored | None:
        """Slots for the keys not stored yet, evicting unpinned blocks to make room; None (and
        nothing changed) if there is not room for all of them."""
        for key in keys:  # a dropped block, no longer read, is written again
            entry = self._entries.get(key)
            if entry is not None and not entry.ready and self._evictable(entry):
                self._remove(key)
        new = [key for key in dict.fromkeys(keys) if key not in self._entries]
        evicted = self._make_room(len(new))
        if evicted is None:
            return None
        slots = []
        for key in new:
            entry = Entry(slot=self._free.pop(), writer=owner)
            self._entries[key] = entry
            slots.append(entry.slot)
        self.touch(keys)
        return Stored(keys=tuple(new), slots=tuple(slots), evicted=tuple(evicted))

    def complete_store(self, keys: Sequence[bytes], owner: int, success: bool) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.writer != owner:
                continue
            entry.writer = None
            if success:
                entry.ready = True
                self._logged(key, loadable=True)
            else:
                self._remove(key)

    def drop(self, keys: Sequence[bytes]) -> None:
        """Forget `keys` (a block whose bytes failed their check); a pinned one is kept until
        its reads end, but is no longer readable."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            self.dropped += 1
            if entry.pins or entry.writer is not None:
                if entry.ready:
                    entry.ready = False
                    self._logged(key, loadable=False)
            else:
                self._remove(key)

    def release_owner(self, owner: int) -> None:
        """A client went away: its pins end and its unfinished writes are discarded."""
        for key, entry in list(self._entries.items()):
            entry.pins.pop(owner, None)
            if entry.writer == owner:
                self._remove(key)

    def _make_room(self, needed: int) -> list[bytes] | None:
        evictable = [key for key, entry in self._entries.items() if self._evictable(entry)]
        if len(self._free) + len(evictable) < needed:
            return None
        evicted: list[bytes] = []
        while len(self._free) < needed:
            victim = next(key for key, entry in self._entries.items() if self._evictable(entry))
            entry = self._entries[victim]
            if entry.reuse > 0:  # read since it last came up: spared for another round
                entry.reuse -= 1
                self._entries.move_to_end(victim)
                continue
            self._remove(victim)
            evicted.append(victim)
        self.evictions += len(evicted)
        return evicted

    @staticmethod
    def _evictable(entry: Entry) -> bool:
        return not entry.pins and entry.writer is None

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._free.append(entry.slot)
        if entry.ready:
            self._logged(key, loadable=False)

    def _logged(self, key: bytes, loadable: bool) -> None:
        self.sequence += 1
        self._changes.append((key, loadable))

    def contents_since(self, since: int) -> Changes:
        """What changed after change number `since`; when those changes are not all logged any
        more (or `since` is not one of this index's), a reset to the loadable keys, at most
        MAX_LOGGED_CHANGES of them, the most recently used (a reader's copy may then lack some
        old keys: it underestimates, never claims a block that is not here)."""
        behind = self.sequence - since
        if not 0 <= behind <= len(self._changes):
            added = []
            for key, entry in reversed(self._entries.items()):  # most recently used first
                if len(added) == MAX_LOGGED_CHANGES:
                    break
                if entry.ready:
                    added.append(key)
            return Changes(self.sequence, reset=True, added=tuple(added), removed=())
        last: dict[bytes, bool] = {}  # each key's latest change
        for key, loadable in islice(reversed(self._changes), behind):
            last.setdefault(key, loadable)
        return Changes(
            self.sequence,
            reset=False,
            added=tuple(key for key, loadable in last.items() if loadable),
            removed=tuple(key for key, loadable in last.items() if not loadable),
        )
