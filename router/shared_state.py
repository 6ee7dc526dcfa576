"""What the routers of one cluster share, in the cluster's Redis, so that several routers agree
and any of them can die or restart without the cluster forgetting what it was told.

Keys, under `pdserve:<cluster>:`:
- `router:<id>`: each router's presence, rewritten every PRESENCE_EVERY_S with a time to live
  of ROUTER_TTL_S; the live count splits the admission capacity between the routers.
- `roles` (hash: flex worker id -> role) and `split` (hash: role -> flex workers wanted): the
  flex split, whoever set it (`POST /pdserve/roles` on any router, or `--flex-auto`).
- `ratio-lease`: the one router whose `--flex-auto` decides, for LEASE_TTL_S, renewed while it
  lives (two deciders would fight over the same workers).
- `prefix`: a stream of the routers' prefix-index additions (router/prefix_index.py), each
  router reading the others' within a poll, bounded to PREFIX_STREAM_LENGTH entries.
- `revoked-keys`: SHA-256 digests of revoked API keys (`pdserve revoke-key`), never the keys.
  A router never forgets one it has seen (a Redis restart, or a delete, does not un-revoke a
  key) and writes back those Redis lacks.

Every router keeps working from its last view while Redis is away; what it changed meanwhile
is written when Redis is back.
"""

import hashlib
import math
import os
import socket
from dataclasses import dataclass

from pdserve.settings.redis_url import connect, masked
from router.prefix_index import DIGEST_BYTES

ROUTER_TTL_S = 3.0
PRESENCE_EVERY_S = 1.0
LEASE_TTL_S = 3.0
PREFIX_STREAM_LENGTH = 100_000  # about 100 MiB of chunk hashes at most


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

    async def announce(self) -> int:
        """Say this router is alive; returns how many are (itself included)."""
        await self.redis.set(f"{self.base}router:{self.me}", "1", px=round(ROUTER_TTL_S * 1000))
        live = [k async for k in self.redis.scan_iter(match=f"{self.base}router:*", count=1000)]
        return max(1, len(live))

    async def leave(self) -> None:
        """No longer counted; the lease, if held here, goes to the next router at once."""
        await self.redis.delete(f"{self.base}router:{self.me}")
        if (await self.redis.get(self.base + "ratio-lease") or b"").decode() == self.me:
            await self.redis.delete(self.base + "ratio-lease")

    async def roles(self) -> tuple[dict[str, str], dict[str, int]]:
        """(flex worker id -> role, role -> workers wanted)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            roles, split = (
                await pipe.hgetall(self.base + "roles").hgetall(self.base + "split").execute()
            )
        return (
            {k.decode(): v.decode() for k, v in roles.items()},
            {k.decode(): int(v) for k, v in split.items()},
        )

    async def set_roles(
        self, moved: dict[str, str], placed: dict[str, tuple[str, bool]], split: dict
    ) -> None:
        """Moves (set_split, --flex-auto) overwrite, and so does the split they set. A joining
        worker's placement only fills a worker no router placed yet (the first router to see it
        decides), and only that router adds it to the split when the placement grew it."""
        async with self.redis.pipeline(transaction=True) as pipe:
            if moved:
                pipe.hset(self.base + "roles", mapping=moved)
            if split:
                pipe.hset(self.base + "split", mapping=split)
            for worker_id, (role, _) in placed.items():
                pipe.hsetnx(self.base + "roles", worker_id, role)
            replies = await pipe.execute()
        firsts = replies[len(replies) - len(placed) :]
        placements = zip(placed.values(), firsts, strict=True)
        grown = [role for (role, grew), first in placements if grew and first]
        if grown:
            async with self.redis.pipeline(transaction=True) as pipe:
                for role in grown:
                    pipe.hincrby(self.base + "split", role, 1)
                await pipe.execute()

    async def hold_ratio_lease(self) -> bool:
        """Take or renew the lease on --flex-auto's decisions; whether this router holds it."""
        key, ttl = self.base + "ratio-lease", round(LEASE_TTL_S * 1000)
        if await self.redis.set(key, self.me, nx=True, px=ttl):
            return True
        if (await self.redis.get(key) or b"").decode() == self.me:
            await self.redis.pexpire(key, ttl)
            return True
        return False

    async def publish_prefixes(self, entries: list[PrefixEntry]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry in entries:
                pipe.xadd(
                    self.base + "prefix",
                    {
                        "router": entry.router,
                        "address": entry.address,
                        "hashes": b"".join(entry.hashes),
                    },
                    maxlen=PREFIX_STREAM_LENGTH,
                    approximate=True,
                )
            await pipe.execute()

    async def prefix_position(self) -> str:
        """The stream's last entry id now: a router reads from there on (what came before,
        it learns as its own index fills)."""
        last = await self.redis.xrevrange(self.base + "prefix", count=1)
        return last[0][0].decode() if last else "0-0"

    async def read_prefixes(self, after: str, count: int = 10_000) -> tuple[list, str]:
        """The entries after id `after` (other routers' and this one's), and the last id read."""
        reply = await self.redis.xread({self.base + "prefix": after}, count=count)
        entries = []
        for _, messages in reply:
            for entry_id, fields in messages:
                after = entry_id.decode()
                raw = fields[b"hashes"]
                entries.append(
                    PrefixEntry(
                        router=fields[b"router"].decode(),
                        address=fields[b"address"].decode(),
                        hashes=tuple(
                            raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)
                        ),
                    )
                )
        return entries, after

    async def revoked_keys(self) -> frozenset[str]:
        return frozenset(d.decode() for d in await self.redis.smembers(self.base + "revoked-keys"))

    async def revoke_key(self, key: str) -> bool:
        """Whether the key was not revoked before."""
        return bool(await self.redis.sadd(self.base + "revoked-keys", key_digest(key)))

    async def put_back_revoked(self, digests: frozenset[str]) -> None:
        """Revocations a router knows that Redis lost (it restarted empty, or they were
        deleted): written back, so that routers started since learn them too."""
        await self.redis.sadd(self.base + "revoked-keys", *sorted(digests))

    async def close(self) -> None:
        await self.redis.aclose()
