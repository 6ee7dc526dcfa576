"""What the routers of one cluster share, in the cluster's Redis, so that several routers agree
and any of them can die or restart without the cluster forgetting what it was told.

Keys, under `pdserve:<cluster>:`:
- `router:<id>`: each router's presence, rewritten every PRESENCE_EVERY_S with a time to live
  of ROUTER_TTL_S; the live count splits the admission capacity between the routers. Its value
  is Redis's clock when written: one older than ROUTER_TTL_S is not counted.
- `flex-roles` (hash: flex worker id -> role) and `flex-split` (hash: role -> flex workers
  wanted): the flex split, whoever set it (`POST /pdserve/roles` on any router, or
  `--flex-auto`). A role is prefill, decode or standby; a worker that has not been a member for
  ROLE_PRUNE_AFTER_S leaves the hash (router/shared/sync.py).
- `ratio-lease`: the one router whose `--flex-auto` decides, for LEASE_TTL_S, renewed while it
  lives (two deciders would fight over the same workers).
- `prefix`: a stream of the routers' prefix-index additions (router/workers/prefix_index.py), each
  router reading the others' within a poll and learning those for its pools' members. An entry
  holds at most MAX_HASHES_PER_ENTRY chunk hashes (a longer prompt's take several), so the
  stream's length bound keeps it under PREFIX_STREAM_BYTES.
- `revoked-keys`: SHA-256 digests of revoked API keys (`pdserve revoke-key`), never the keys.
  A router never forgets one it has seen (a Redis restart, or a delete, does not un-revoke a
  key) and writes back those Redis lacks.

Everything but `revoked-keys` is signed with the cluster secret (pdserve/settings/
cluster_secret.py's `signature`, as the registry's records are), over the key, the hash field
and the value: what a process that can write to Redis but lacks the secret puts there is
ignored and counted in `refused` (and logged once per key). It can still delete what is there
(the routers write their view back) but not forge a role, a split, a router's presence, the
lease or a prefix entry. A revocation needs no signature: it can only refuse a key whose digest
the writer knows, and deleting one un-revokes nothing.

Every router keeps working from its last view while Redis is away; what it changed meanwhile
is written when Redis is back.
"""

import hashlib
import json
import logging
import math
import os
import socket
from dataclasses import dataclass

import redis.exceptions

from pdserve.core.kinds import Role
from pdserve.settings.cluster_secret import signature, signature_valid
from pdserve.settings.redis_url import connect, masked
from router.workers.prefix_index import DIGEST_BYTES

log = logging.getLogger("pdserve.router")
ROUTER_TTL_S = 3.0
PRESENCE_EVERY_S = 1.0
LEASE_TTL_S = 3.0
CLOCK_SLACK_MS = 1000  # a presence written this far in Redis's future still counts
STANDBY = "standby"  # a flex worker in no pool (a sweep's ratio with fewer workers)
SHARED_ROLES = (Role.PREFILL.value, Role.DECODE.value, STANDBY)
MAX_SPLIT = 100_000  # flex workers wanted in one role: more is not a split a router set
PREFIX_STREAM_BYTES = 64 << 20  # the prefix stream's size in Redis at most
MAX_HASHES_PER_ENTRY = 128  # 8192 tokens' chunks (2 KiB) per stream entry
ENTRY_OVERHEAD_BYTES = 1024  # an entry's router id, address, signature and Redis's own
MAX_LOGGED_REFUSALS = 1000  # keys whose refusal is logged (once each)


def prefix_stream_length() -> int:
    """The stream's length bound: PREFIX_STREAM_BYTES of the largest entries."""
    largest = MAX_HASHES_PER_ENTRY * DIGEST_BYTES + ENTRY_OVERHEAD_BYTES
    return max(1, PREFIX_STREAM_BYTES // largest)


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def _number(text: str | None, most: int) -> int | None:
    """The whole number `text` spells (ASCII digits, at most `most`), else None."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text) if int(text) <= most else None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def router_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


@dataclass(frozen=True)
class PrefixEntry:
    """One router's addition to its prefix index: a prompt's chunks sent to a worker."""

    router: str
    address: str
    hashes: tuple[bytes, ...]


@dataclass
class Peers:
    """How many routers share the cluster (1 without shared state)."""

    routers: int = 1

    def share(self, total: int) -> int:
        """This router's part of a cluster-wide bound (at least 1 while the total is)."""
        return max(1, math.ceil(total / self.routers)) if total > 0 else total


class SharedState:
    def __init__(self, url: str, cluster: str, me: str) -> None:
        self.url = masked(url)  # for messages
        self.base = f"pdserve:{cluster}:"
        self.me = me
        self.redis = connect(url)
        self.refused = 0  # entries read without a valid signature (or value), ignored
        self._refusals_logged: set[str] = set()
        # The flex-roles hash's fields at the last read (name -> as stored, to delete), and
        # those whose value was not signed (a placement here replaces them).
        self.role_fields: dict[str, bytes] = {}
        self.unsigned_roles: set[str] = set()

    def _signature(self, *parts: str) -> str:
        return signature(json.dumps(parts))

    def _sealed(self, value: str, *where: str) -> str:
        """`value` as stored at `where` (a key, and a hash field): followed by its signature."""
        return f"{value} {self._signature(*where, value)}"

    def _opened(self, raw: bytes | None, *where: str) -> str | None:
        """The value `raw` (as read from `where`) holds, if signed for there; else None."""
        try:
            value, space, mac = raw.decode().rpartition(" ")
        except (AttributeError, UnicodeDecodeError):
            return None
        return value if space and signature_valid(json.dumps([*where, value]), mac) else None

    def _refuse(self, what: str) -> None:
        self.refused += 1
        if what not in self._refusals_logged and len(self._refusals_logged) < MAX_LOGGED_REFUSALS:
            self._refusals_logged.add(what)
            log.warning(
                "ignored %s in the shared state at %s: not signed with the cluster secret, "
                "or not a value a router writes",
                what,
                self.url,
            )

    async def announce(self) -> int:
        """Say this router is alive; returns how many are (itself included): the presences
        signed with the cluster secret and written within ROUTER_TTL_S by Redis's clock."""
        seconds, micros = await self.redis.time()
        now_ms, ttl_ms = seconds * 1000 + micros // 1000, round(ROUTER_TTL_S * 1000)
        mine = f"{self.base}router:{self.me}"
        await self.redis.set(mine, self._sealed(str(now_ms), mine), px=ttl_ms)
        keys = [k async for k in self.redis.scan_iter(match=f"{self.base}router:*", count=1000)]
        values = await self.redis.mget(keys) if keys else []
        live = 0
        for key, raw in zip(keys, values, strict=True):
            if raw is None:  # expired between SCAN and MGET
                continue
            name = key.decode(errors="replace")
            written = _number(self._opened(raw, name), now_ms + CLOCK_SLACK_MS)
            if written is None or written < now_ms - ttl_ms:  # unsigned, or a stale one replayed
                self._refuse(f"router presence {name}")
            else:
                live += 1
        return max(1, live)

    async def leave(self) -> None:
        """No longer counted; the lease, if held here, goes to the next router at once."""
        await self.redis.delete(f"{self.base}router:{self.me}")
        lease = self.base + "ratio-lease"
        if self._opened(await self.redis.get(lease), lease) == self.me:
            await self.redis.delete(lease)

    async def roles(self) -> tuple[dict[str, str], dict[str, int]]:
        """(flex worker id -> role, role -> workers wanted), as signed; also notes every field
        of the roles hash (`role_fields`) and those not signed (`unsigned_roles`)."""
        roles_key, split_key = self.base + "flex-roles", self.base + "flex-split"
        async with self.redis.pipeline(transaction=True) as pipe:
            stored_roles, stored_split = await pipe.hgetall(roles_key).hgetall(split_key).execute()
        roles = {}
        self.role_fields, self.unsigned_roles = {}, set()
        for field, raw in stored_roles.items():
            worker = field.decode(errors="replace")
            self.role_fields[worker] = field
            role = self._opened(raw, roles_key, worker)
            if role in SHARED_ROLES:
                roles[worker] = role
            else:
                self.unsigned_roles.add(worker)
                self._refuse(f"flex role of {worker}")
        return roles, self._split(stored_split)

    def _split(self, stored: dict[bytes, bytes]) -> dict[str, int]:
        split_key, split = self.base + "flex-split", {}
        for field, raw in stored.items():
            role = field.decode(errors="replace")
            wanted = _number(self._opened(raw, split_key, role), MAX_SPLIT)
            if role in SHARED_ROLES and wanted is not None:
                split[role] = wanted
            else:
                self._refuse(f"flex split of {role}")
        return split

    async def set_roles(
        self, moved: dict[str, str], placed: dict[str, tuple[str, bool]], split: dict[str, int]
    ) -> None:
        """Moves (set_split, --flex-auto) overwrite, and so does the split they set. A joining
        worker's placement only fills a worker no router placed yet (the first router to see it
        decides; a value not signed counts as none), and only that router adds it to the split
        when the placement grew it."""
        roles_key, split_key = self.base + "flex-roles", self.base + "flex-split"
        async with self.redis.pipeline(transaction=True) as pipe:
            if moved:
                sealed = {w: self._sealed(role, roles_key, w) for w, role in moved.items()}
                pipe.hset(roles_key, mapping=sealed)
            if split:
                sealed = {r: self._sealed(str(n), split_key, r) for r, n in split.items()}
                pipe.hset(split_key, mapping=sealed)
            for worker_id, (role, _) in placed.items():
                if worker_id in self.unsigned_roles:  # replaced: this placement is the first
                    pipe.hset(roles_key, worker_id, self._sealed(role, roles_key, worker_id))
                else:
                    pipe.hsetnx(roles_key, worker_id, self._sealed(role, roles_key, worker_id))
            replies = await pipe.execute()
        firsts = replies[len(replies) - len(placed) :]
        placements = zip(placed.items(), firsts, strict=True)
        grown = [
            role
            for (worker_id, (role, grew)), first in placements
            if grew and (first or worker_id in self.unsigned_roles)
        ]
        if grown:
            await self._add_to_split(grown)

    async def _add_to_split(self, grown: list[str]) -> None:
        """One more wanted in each role of `grown`; read, checked and written back at once (no
        other router's write in between), as the values are signed."""
        split_key = self.base + "flex-split"
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(split_key)
                    split = self._split(await pipe.hgetall(split_key))
                    for role in grown:
                        split[role] = split.get(role, 0) + 1
                    pipe.multi()
                    pipe.hset(
                        split_key,
                        mapping={r: self._sealed(str(split[r]), split_key, r) for r in grown},
                    )
                    await pipe.execute()
                    return
                except redis.exceptions.WatchError:  # another router wrote it: read again
                    continue

    async def forget_roles(self, workers: list[str]) -> None:
        """Workers gone for good leave the roles hash (L5: it would grow with every new id)."""
        fields = [self.role_fields.get(worker, worker.encode()) for worker in workers]
        if fields:
            await self.redis.hdel(self.base + "flex-roles", *fields)

    async def hold_ratio_lease(self) -> bool:
        """Take or renew the lease on --flex-auto's decisions; whether this router holds it. A
        lease not signed is held by nobody: it is replaced."""
        key, ttl = self.base + "ratio-lease", round(LEASE_TTL_S * 1000)
        sealed = self._sealed(self.me, key)
        if await self.redis.set(key, sealed, nx=True, px=ttl):
            return True
        raw = await self.redis.get(key)
        holder = self._opened(raw, key)
        if holder == self.me:
            await self.redis.pexpire(key, ttl)
            return True
        if raw is not None and holder is None:
            self._refuse("ratio lease")
            return bool(await self.redis.eval(_REPLACE_IF_SAME, 1, key, raw, sealed, ttl))
        return False

    async def publish_prefixes(self, entries: list[PrefixEntry]) -> None:
        key, length = self.base + "prefix", prefix_stream_length()
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                for start in range(0, len(entry.hashes), MAX_HASHES_PER_ENTRY):
                    hashes = b"".join(entry.hashes[start : start + MAX_HASHES_PER_ENTRY])
                    fields = {"router": entry.router, "address": entry.address, "hashes": hashes}
                    mac = self._signature(key, entry.router, entry.address, hashes.hex())
                    pipe.xadd(key, {**fields, "mac": mac}, maxlen=length, approximate=True)
            await pipe.execute()

    async def prefix_position(self) -> str:
        """The stream's last entry id now: a router reads from there on (what came before,
        it learns as its own index fills)."""
        last = await self.redis.xrevrange(self.base + "prefix", count=1)
        return last[0][0].decode() if last else "0-0"

    async def read_prefixes(self, after: str, count: int = 10_000) -> tuple[list[PrefixEntry], str]:
        """The signed entries after id `after` (other routers' and this one's), and the last
        id read."""
        reply = await self.redis.xread({self.base + "prefix": after}, count=count)
        entries = []
        for _, messages in reply:
            for entry_id, fields in messages:
                after = entry_id.decode()
                entry = self._prefix_entry(fields)
                if entry is None:
                    self._refuse("prefix-stream entry")
                else:
                    entries.append(entry)
        return entries, after

    def _prefix_entry(self, fields: dict[bytes, bytes]) -> PrefixEntry | None:
        try:
            router, address = fields[b"router"].decode(), fields[b"address"].decode()
            raw, mac = fields[b"hashes"], fields[b"mac"].decode()
        except (KeyError, UnicodeDecodeError):
            return None
        if len(raw) % DIGEST_BYTES or len(raw) > MAX_HASHES_PER_ENTRY * DIGEST_BYTES:
            return None
        message = json.dumps([self.base + "prefix", router, address, raw.hex()])
        if not signature_valid(message, mac):
            return None
        hashes = tuple(raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES))
        return PrefixEntry(router=router, address=address, hashes=hashes)

    async def revoked_keys(self) -> frozenset[str]:
        """The digests revoked (signed or not: a revocation only ever refuses a key); what is
        not a SHA-256 digest is ignored."""
        digests = set()
        for member in await self.redis.smembers(self.base + "revoked-keys"):
            digest = member.decode(errors="replace")
            if _is_digest(digest):
                digests.add(digest)
            else:
                self._refuse("revoked-keys member")
        return frozenset(digests)

    async def revoke_key(self, key: str) -> bool:
        """Whether the key was not revoked before."""
        return bool(await self.redis.sadd(self.base + "revoked-keys", key_digest(key)))

    async def put_back_revoked(self, digests: frozenset[str]) -> None:
        """Revocations a router knows that Redis lost (it restarted empty, or they were
        deleted): written back, so that routers started since learn them too."""
        await self.redis.sadd(self.base + "revoked-keys", *sorted(digests))

    async def close(self) -> None:
        await self.redis.aclose()


# The lease's value, replaced only if it is still the one read (not signed: nobody's).
_REPLACE_IF_SAME = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return false
"""
