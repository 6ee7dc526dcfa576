"""The loop that keeps this router's view equal to what the cluster's routers share in Redis
(router/shared/state.py): every `interval_s`, the flex split (this router's changes out, the
others' in), the prefix index's additions both ways, the lease on --flex-auto's decisions;
every PRESENCE_EVERY_S, its presence (so the others count it) and the revoked API keys (merged
both ways: a revocation Redis lost is written back from the routers' memory). A flex worker
that has not been a member of this router's pools for ROLE_PRUNE_AFTER_S leaves the shared
roles; another router's prefix-index additions are learned only for this router's members.
What Redis holds unsigned is ignored (router/shared/state.py) and counted.

A role changed through one router is in effect at every other within two intervals (0.2 s by
default). While Redis is away each router serves from its last view and says so in its log
once per outage; what it changed meanwhile is shared when Redis answers again.
"""

import asyncio
import contextlib
import logging
import time

from router.shared.state import PRESENCE_EVERY_S, Peers, PrefixEntry, SharedState
from router.workers.flex_roles import FlexRoles
from router.workers.prefix_index import PrefixIndex

log = logging.getLogger("pdserve.router")
SHARE_NOW_TIMEOUT_S = 1.0
MAX_UNSHARED_PREFIXES = 10_000  # kept while Redis is away (the newest; older ones age out)
LEAVE_TIMEOUT_S = 2.0
# A worker id absent from the pools this long leaves the shared roles (K8s names a restarted
# pod anew: the hash would grow with every restart). Long enough for every router to have seen
# a joining worker, which the first router to see it placed.
ROLE_PRUNE_AFTER_S = 60.0


class StateSync:
    def __init__(
        self,
        shared: SharedState,
        roles: FlexRoles,
        index: PrefixIndex | None,
        peers: Peers,
        flex_auto: bool,
        metrics=None,
    ) -> None:
        """`metrics`: router/metrics.py's RouterMetrics, for the router count and failures."""
        self.shared = shared
        self.roles = roles
        self.index = index
        self.peers = peers
        self.flex_auto = flex_auto
        self.metrics = metrics
        self.revoked: frozenset[str] = frozenset()  # SHA-256 digests of revoked API keys
        self.prefix_after: str | None = None  # the last prefix-stream entry read
        self.presence_at = -PRESENCE_EVERY_S
        self.failing = False
        self.prune_after_s = ROLE_PRUNE_AFTER_S
        self.absent_since: dict[str, float] = {}  # worker id in the shared roles -> since when
        self.refused_counted = 0  # of shared.refused, in the metrics
        # A read of the shared split and the taking of it are not interleaved with a write of
        # this router's changes: a read begun before a write would undo it here.
        self.roles_lock = asyncio.Lock()
        self.stopping = asyncio.Event()  # `stop`: the loop ends between two rounds
        if index is not None:
            index.outbox = []
        if flex_auto:
            roles.leads_ratio = False  # until the lease is held

    async def once(self) -> None:
        """One round; raises when Redis does not answer (the caller logs and retries)."""
        now = time.monotonic()
        if now - self.presence_at >= PRESENCE_EVERY_S:
            self.peers.routers = await self.shared.announce()
            await self.sync_revoked()
            if self.metrics is not None:
                self.metrics.routers.set(self.peers.routers)
            self.presence_at = now
        async with self.roles_lock:
            await self.push_roles()
            self.roles.take_shared(*await self.shared.roles())
            await self.prune_roles(now)
        if self.flex_auto:
            self.roles.leads_ratio = await self.shared.hold_ratio_lease()
        if self.index is not None:
            await self.sync_prefixes()
        self.count_refused()

    def members(self) -> list:
        """This router's pools' workers (WorkerClients)."""
        return self.roles.pool.workers

    async def prune_roles(self, now: float) -> None:
        """Shared roles of workers absent from this router's pools for `prune_after_s` are
        deleted (a worker that comes back later is placed again)."""
        present = {worker.identity.worker_id for worker in self.members()}
        named = self.shared.role_fields
        self.absent_since = {w: t for w, t in self.absent_since.items() if w in named}
        gone = []
        for worker_id in named:
            if worker_id in present:
                self.absent_since.pop(worker_id, None)
            elif now - self.absent_since.setdefault(worker_id, now) >= self.prune_after_s:
                gone.append(worker_id)
        if gone:
            await self.shared.forget_roles(gone)
            log.info(
                "forgot the shared roles of %d workers gone for %g s: %s",
                len(gone),
                self.prune_after_s,
                ", ".join(gone[:10]) + (", ..." if len(gone) > 10 else ""),
            )
            for worker_id in gone:
                del self.absent_since[worker_id]

    def count_refused(self) -> None:
        """Entries ignored for want of a signature, into the router's metrics when they have
        a counter for them (`shared_state_refused`)."""
        counter = getattr(self.metrics, "shared_state_refused", None)
        if counter is not None and self.shared.refused > self.refused_counted:
            counter.inc(self.shared.refused - self.refused_counted)
        self.refused_counted = self.shared.refused

    async def sync_revoked(self) -> None:
        """Revocations are only ever added: those Redis holds join this router's, and those it
        lacks (it restarted empty: no persistence) are written back from this router's memory.
        A revoked key stays refused while Redis or any router that has seen it holds it: only
        Redis and every router restarting together forget it."""
        shared = await self.shared.revoked_keys()
        if self.revoked - shared:
            await self.shared.put_back_revoked(self.revoked - shared)
        self.revoked = self.revoked | shared

    async def push_roles(self) -> None:
        changes = self.roles.changes()
        if not any(changes[:3]):
            return
        try:
            await self.shared.set_roles(*changes)
        except BaseException:
            self.roles.unshared(*changes)
            raise

    async def share_roles_now(self) -> None:
        """A change asked of this router, shared before it answers; should Redis not answer,
        the next round shares it."""
        try:
            async with asyncio.timeout(SHARE_NOW_TIMEOUT_S), self.roles_lock:
                await self.push_roles()
        except Exception as error:
            log.warning("role change not shared yet (%s); the next round shares it", error)

    async def sync_prefixes(self) -> None:
        if self.prefix_after is None:
            self.prefix_after = await self.shared.prefix_position()
        outbox, self.index.outbox = self.index.outbox, []
        mine = [PrefixEntry(self.shared.me, address, tuple(h)) for address, h in outbox]
        try:
            if mine:
                await self.shared.publish_prefixes(mine)
        except BaseException:
            self.index.outbox = (outbox + self.index.outbox)[-MAX_UNSHARED_PREFIXES:]
            raise
        entries, self.prefix_after = await self.shared.read_prefixes(self.prefix_after)
        members = {worker.address for worker in self.members()}  # no index for anyone else
        for entry in entries:
            if entry.router != self.shared.me and entry.address in members:
                self.index.learn(entry.address, list(entry.hashes))

    def stop(self) -> None:
        """End `follow` after its round: a Redis command cancelled midway can leave the
        client's connection pool locked (redis-py), and the next command then waits forever."""
        self.stopping.set()

    async def follow(self, interval_s: float) -> None:
        """Until `stop` (or cancel); leaves the shared presence at the end."""
        try:
            while not self.stopping.is_set():
                try:
                    await self.once()
                    if self.failing:
                        log.info("shared state at %s answers again", self.shared.url)
                    self.failing = False
                except Exception as error:  # Redis away: serve from the last view
                    if self.metrics is not None:
                        self.metrics.shared_state_failures.inc()
                    if not self.failing:
                        log.warning(
                            "cannot reach the shared state at %s (serving from the last view): %s",
                            self.shared.url,
                            error,
                        )
                    self.failing = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), interval_s)
        finally:
            try:
                async with asyncio.timeout(LEAVE_TIMEOUT_S):
                    await self.shared.leave()
            except Exception:  # gone anyway once its presence expires
                pass
