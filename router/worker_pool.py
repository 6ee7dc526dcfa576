"""The workers the router may send a request to, by role, and the choice among them.

Membership comes from one of two places: a fixed list of addresses (`pdserve serve`, one host,
no Redis), or the cluster's Redis registry (`pdserve up`), which `follow_registry` reads every
0.1 s, so workers join and leave with no router restart. A worker joins once its
Health says READY. A worker that leaves membership gets no new request; its requests in flight
finish, and its channel closes once none is left.

Each worker says its role in Health. Decode and colocated workers take whole requests (and
the decode leg of disaggregated ones); prefill workers take prefill legs. A worker that answered
UNAVAILABLE is skipped until its Health says READY again; with no worker left for a leg the
router answers 503 instead of waiting.
"""

import asyncio
import logging

import grpc

from pdserve.kinds import Role
from pdserve.worker.protocol import worker_pb2
from router.errors import worker_unavailable
from router.worker_client import WorkerClient
from router.worker_load import LOAD_POLL_S

log = logging.getLogger("pdserve.router")
TAKES_REQUESTS = (Role.DECODE, Role.COLOCATED)  # whole requests, and disaggregated decode legs


class WorkerPool:
    def __init__(self, addresses: list[str], policy) -> None:
        self.workers = [WorkerClient(address) for address in addresses]
        self.down: set[str] = set()
        self.policy = policy
        self.leaving: list[WorkerClient] = []  # out of membership, requests still in flight
        self._max_model_len = 0

    async def wait_ready(self, deadline_s: float) -> None:
        """Wait until every worker is READY, or raise TimeoutError naming the slow ones."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline_s
        pending = list(self.workers)
        while pending:
            pending = [w for w in pending if not await self._is_ready(w)]
            if pending and loop.time() > give_up:
                raise TimeoutError(
                    "workers not ready after {:.0f} s: {}".format(
                        deadline_s, ", ".join(w.address for w in pending)
                    )
                )
            if pending:
                await asyncio.sleep(0.5)

    async def _is_ready(self, worker: WorkerClient) -> bool:
        try:
            return (await worker.health(timeout=2.0)).state == worker_pb2.HealthReply.READY
        except grpc.aio.AioRpcError:  # not listening yet, or gone
            return False

    def live(self, roles: tuple[Role, ...]) -> list[WorkerClient]:
        return [w for w in self.workers if w.role in roles and w.address not in self.down]

    def capacity(self) -> int:
        """Requests the live decode and colocated workers run at once: their engines'
        max_num_seqs, less while an engine holds requests back for want of KV blocks."""
        return sum(w.load.capacity(w.max_num_seqs) for w in self.live(TAKES_REQUESTS))

    def health(self) -> tuple[bool, dict]:
        """Whether the cluster can serve a request (a decode or colocated worker is up; prefill
        workers are optional), and what is up, by pool."""
        live = [w for w in self.workers if w.address not in self.down]
        pools = {
            role: sum(w.role == role for w in live)
            for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED)
        }
        serving = bool(pools[Role.DECODE] or pools[Role.COLOCATED])
        return serving, {
            "status": "ok" if serving else "unavailable",
            "workers": [w.worker_id for w in live],
            "pools": pools,
            "down": sorted(w.worker_id for w in self.workers if w.address in self.down),
        }

    def pick(
        self,
        roles: tuple[Role, ...],
        avoid: frozenset[str] = frozenset(),
        pairs_with: WorkerClient | None = None,
        prompt: list[int] = (),
    ) -> WorkerClient:
        """`pairs_with`: only workers whose KV that worker can take (equal compatibility
        fingerprints: the handshake between them would succeed). `prompt`: the request's token
        ids, for a policy that weighs prefix-cache hits."""
        candidates = [w for w in self.live(roles) if w.address not in avoid]
        if not candidates:
            raise worker_unavailable(f"no {' or '.join(roles)} worker is available; retry later")
        if pairs_with is not None:
            fingerprint = pairs_with.kv_compatibility
            others = candidates
            candidates = [w for w in candidates if w.kv_compatibility == fingerprint]
            if not candidates:
                theirs = "; ".join(f"{w.worker_id} has {w.kv_compatibility}" for w in others)
                raise worker_unavailable(
                    f"no {' or '.join(roles)} worker's KV is compatible with worker "
                    f"{pairs_with.worker_id}'s ({fingerprint}): {theirs}"
                )
        return self.policy.choose(candidates, prompt)

    def computes(self, worker: WorkerClient, prompt: list[int]) -> None:
        """`worker` computes `prompt` (or receives its KV): for a policy that tracks caches."""
        self.policy.computes(worker, prompt)

    def cached_tokens(self, worker: WorkerClient, prompt: list[int]) -> int:
        """Of `prompt`, the leading tokens `worker` likely has cached (0 when the policy keeps
        no index)."""
        return self.policy.cached_tokens(worker, prompt)

    def mark_down(self, worker: WorkerClient) -> None:
        log.warning("worker %s marked down", worker.address)
        self.down.add(worker.address)

    async def refresh(self) -> None:
        """Bring workers back that answer READY again."""
        for worker in self.workers:
            if worker.address in self.down and await self._is_ready(worker):
                log.info("worker %s is back", worker.address)
                self.down.discard(worker.address)

    async def sync(self, addresses: list[str]) -> None:
        """Make membership exactly `addresses`: new ones join when READY, missing ones leave."""
        current = {w.address: w for w in self.workers}
        for address in addresses:
            if address not in current:
                joining = WorkerClient(address)
                if await self._is_ready(joining):
                    log.info("worker %s (%s) joined", joining.worker_id, joining.role)
                    self.workers.append(joining)
                else:
                    await joining.close()
        for worker in [w for w in self.workers if w.address not in addresses]:
            log.info("worker %s left", worker.worker_id)
            self.workers.remove(worker)
            self.down.discard(worker.address)
            self.leaving.append(worker)
        for worker in [w for w in self.leaving if w.users == 0]:
            self.leaving.remove(worker)
            await worker.close()

    @property
    def max_model_len(self) -> int:
        """The smallest context of the members; the last one known while the pools are empty."""
        if self.workers:
            self._max_model_len = min(w.max_model_len for w in self.workers)
        return self._max_model_len

    async def close(self) -> None:
        for worker in self.workers + self.leaving:
            await worker.close()


async def follow_load(pool: WorkerPool, interval_s: float = LOAD_POLL_S) -> None:
    """Forever (cancel to stop): every live worker's Stats into its `load`. A worker that no
    longer answers at all (UNAVAILABLE: its process is gone) is marked down at once, before a
    request finds out; a slow answer (a busy host) is not held against it."""
    while True:
        workers = [w for w in pool.workers if w.address not in pool.down]
        replies = await asyncio.gather(
            *(w.stats(timeout=interval_s * 4) for w in workers), return_exceptions=True
        )
        for worker, reply in zip(workers, replies, strict=True):
            if isinstance(reply, worker_pb2.StatsReply):
                worker.load.reported(reply)
            elif (
                isinstance(reply, grpc.aio.AioRpcError)
                and reply.code() == grpc.StatusCode.UNAVAILABLE
                and worker in pool.workers
            ):
                pool.mark_down(worker)
        await asyncio.sleep(interval_s)


async def follow_registry(pool: WorkerPool, registry, interval_s: float, joined=None) -> None:
    """Keep `pool` equal to the registry's membership, forever (cancel to stop); `joined()`
    after each sync (flex workers that joined get their role)."""
    while True:
        try:
            await pool.sync([record.address for record in await registry.members()])
            if joined is not None:
                joined()
        except Exception as error:  # Redis away for a moment: keep the last membership
            log.warning("cannot read the registry at %s: %s", registry.url, error)
        await asyncio.sleep(interval_s)
