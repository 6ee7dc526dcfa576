"""The workers the router may send a request to, by role: membership, liveness and load. Which
of them takes a request is router/workers/choice.py's.

Membership comes from one of two places: a fixed list of addresses (`pdserve serve`, one host,
no Redis), or the cluster's Redis registry (`pdserve up`), which `follow_registry` reads every
0.1 s, so workers join and leave with no router restart. A worker joins once its
Health says READY. A worker that leaves membership gets no new request; its requests in flight
finish, and its channel closes once none is left.

Each worker says its role in Health. Decode and colocated workers take whole requests (and
the decode leg of disaggregated ones); prefill workers take prefill legs. A worker that answered
UNAVAILABLE is skipped until its Health says READY again; one that stops answering at all (hung:
its calls neither answered nor refused) leaves the pools after `--worker-unresponsive-timeout`
and returns once it answers again (router/workers/liveness.py). A request with no decode or
colocated worker to try waits up to --worker-wait for one, then answers 503
(router/flow/retries.py).
"""

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from pdserve.core.kinds import Role
from pdserve.protocol import worker_pb2
from pdserve.settings.router import UNRESPONSIVE_TIMEOUT_S
from router.workers.client import WorkerClient
from router.workers.handle import WorkerHandle
from router.workers.kv_pool_contents import PoolContents
from router.workers.liveness import Liveness
from router.workers.load import LOAD_POLL_S

log = logging.getLogger("pdserve.router")
TAKES_REQUESTS = (Role.DECODE, Role.COLOCATED)  # whole requests, and disaggregated decode legs
# After a registry restart, how long its workers have to write their records again: a few
# heartbeats (1 s by default; a cluster file's registry.heartbeat_s beyond 2 s wants more).
RESTART_HOLD_S = 5.0
LIVE_POLL_S = 0.05  # how often a request waiting for a live worker looks at the pools


class WorkerPool:
    def __init__(self, addresses: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.workers: list[WorkerHandle] = [WorkerClient(address) for address in addresses]
        self.down: set[str] = set()  # answered UNAVAILABLE: back when Health says READY
        self.clock = clock  # monotonic seconds: liveness, and a wait for a live worker
        now = clock()
        self.liveness = {address: Liveness(now) for address in addresses}  # by address
        self.pool_contents = PoolContents()  # what the members' host KV pools hold
        self.leaving: list[WorkerHandle] = []  # out of membership, requests still in flight
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

    async def _is_ready(self, worker: WorkerHandle) -> bool:
        try:
            state = (await worker.health(timeout=2.0)).state
        except grpc.aio.AioRpcError:  # not listening yet, or gone
            self.heard(worker, answered=False)
            return False
        self.heard(worker, answered=True)
        return state == worker_pb2.HealthReply.READY

    def heard(self, worker: WorkerHandle, answered: bool) -> None:
        """A member's call was answered, or failed (refused, timed out): for its liveness."""
        if worker not in self.workers:  # a joining worker: its liveness starts when it joins
            return
        if answered:
            self._liveness(worker).answered(self.clock())
        else:
            self._liveness(worker).missed()

    def _liveness(self, worker: WorkerHandle) -> Liveness:
        liveness = self.liveness.get(worker.address)  # (asked several times by every request)
        if liveness is None:
            liveness = self.liveness[worker.address] = Liveness(self.clock())
        return liveness

    def serving(self, worker: WorkerHandle) -> bool:
        """Neither marked down nor taken out for not answering."""
        return worker.address not in self.down and self._liveness(worker).serving

    def live(self, roles: tuple[Role, ...]) -> list[WorkerHandle]:
        return [w for w in self.workers if w.role in roles and self.serving(w)]

    async def wait_for_live(
        self, roles: tuple[Role, ...], wait_s: float, avoid: frozenset[str] = frozenset()
    ) -> None:
        """Return once a worker of `roles` not in `avoid` is live, or after `wait_s`."""
        deadline = self.clock() + wait_s
        while self.clock() < deadline and not [
            w for w in self.live(roles) if w.address not in avoid
        ]:
            await asyncio.sleep(LIVE_POLL_S)

    def unresponsive(self) -> list[WorkerHandle]:
        """Members out of the pools for not answering."""
        return [w for w in self.workers if not self._liveness(w).serving]

    def judge(self, now: float, deadline_s: float) -> tuple[list, list]:
        """(taken out, back): members silent past `deadline_s` leave the pools, members taken
        out that answered long enough return. A worker marked down is Health's to bring back."""
        out, back = [], []
        for worker in self.workers:
            liveness = self._liveness(worker)
            if worker.address not in self.down and liveness.goes_out(now, deadline_s):
                log.warning(
                    "worker %s (%s) answered nothing for %.1f s: out of the pools until it "
                    "answers for %.0f s",
                    worker.identity.worker_id,
                    worker.role,
                    now - liveness.last_answer,
                    liveness.back_after(now),
                )
                out.append(worker)
            elif liveness.comes_back(now):
                log.info(
                    "worker %s (%s) answers again: back in the pools",
                    worker.identity.worker_id,
                    worker.role,
                )
                back.append(worker)
        return out, back

    def capacity(self) -> int:
        """Requests the live decode and colocated workers run at once: their engines'
        max_num_seqs, less while an engine holds requests back for want of KV blocks."""
        return sum(w.load.capacity(w.identity.max_num_seqs) for w in self.live(TAKES_REQUESTS))

    def health(self) -> tuple[bool, dict]:
        """Whether the cluster can serve a request (a decode or colocated worker is up; prefill
        workers are optional), and what is up, by pool."""
        live = [w for w in self.workers if self.serving(w)]
        pools = {
            role: sum(w.role == role for w in live)
            for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED)
        }
        serving = bool(pools[Role.DECODE] or pools[Role.COLOCATED])
        return serving, {
            "status": "ok" if serving else "unavailable",
            "workers": [w.identity.worker_id for w in live],
            "pools": pools,
            "down": sorted(w.identity.worker_id for w in self.workers if w.address in self.down),
            "unresponsive": sorted(w.identity.worker_id for w in self.unresponsive()),
        }

    def mark_down(self, worker: WorkerHandle) -> None:
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
                    log.info("worker %s (%s) joined", joining.identity.worker_id, joining.role)
                    self.workers.append(joining)
                    self.liveness[address] = Liveness(self.clock())
                else:
                    await joining.close()
        for worker in [w for w in self.workers if w.address not in addresses]:
            log.info("worker %s left", worker.identity.worker_id)
            self.workers.remove(worker)
            self.down.discard(worker.address)
            self.liveness.pop(worker.address, None)
            self.leaving.append(worker)
        self.pool_contents.forget_unused(self.workers)
        for worker in [w for w in self.leaving if w.users == 0]:
            self.leaving.remove(worker)
            await worker.close()

    @property
    def max_model_len(self) -> int:
        """The smallest context of the members; the last one known while the pools are empty."""
        if self.workers:
            self._max_model_len = min(w.identity.max_model_len for w in self.workers)
        return self._max_model_len

    async def close(self) -> None:
        for worker in self.workers + self.leaving:
            await worker.close()


async def follow_load(
    pool: WorkerPool,
    interval_s: float = LOAD_POLL_S,
    unresponsive_s: float = UNRESPONSIVE_TIMEOUT_S,
    metrics=None,
) -> None:
    """Forever (cancel to stop): every worker's Stats into its `load`, one call in flight per
    worker, so a hung one delays no other's. A worker that no longer answers at all
    (UNAVAILABLE: its process is gone) is marked down at once, before a request finds out; one
    whose calls go unanswered is taken out once it has been silent `unresponsive_s` (a slow
    answer from a busy host is only late, not held against it), and counted in `metrics`
    (RouterMetrics)."""
    polls: dict[WorkerHandle, asyncio.Task] = {}
    try:
        while True:
            for worker in pool.workers:
                if worker.address not in pool.down and worker not in polls:
                    request = pool.pool_contents.stats_request(worker)
                    polls[worker] = asyncio.create_task(worker.stats(request, unresponsive_s))
            await asyncio.sleep(interval_s)
            for worker, poll in list(polls.items()):
                if worker not in pool.workers:  # it left the pools
                    poll.cancel()
                    del polls[worker]
                elif poll.done():
                    del polls[worker]
                    _take_stats(pool, worker, poll)
            out, back = pool.judge(pool.clock(), unresponsive_s)
            if metrics is not None:
                for worker in out:
                    metrics.unresponsive.labels(worker.role).inc()
                metrics.unresponsive_now.set(len(pool.unresponsive()))
    finally:
        for poll in polls.values():
            poll.cancel()


def _take_stats(pool: WorkerPool, worker: WorkerHandle, poll: asyncio.Task) -> None:
    error = poll.exception()
    pool.heard(worker, answered=error is None)
    if error is None:
        reply = poll.result()
        worker.load.reported(reply)
        if reply.HasField("kv_pool_contents"):
            pool.pool_contents.update(worker, reply.kv_pool_contents)
        else:  # its store did not answer: nothing is known to be loadable
            pool.pool_contents.lost(worker)
    elif isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE:
        pool.mark_down(worker)


async def follow_registry(
    pool: WorkerPool,
    registry,
    interval_s: float,
    joined=None,
    metrics=None,
    synced: asyncio.Event | None = None,
) -> None:
    """Keep `pool` equal to the registry's membership, forever (cancel to stop); `joined()`
    after each sync (flex workers that joined get their role); `synced` is set after the first
    one; records ignored for want of a valid signature are counted in `metrics`
    (RouterMetrics). After the registry's Redis restarted (its run id changed) nobody leaves
    for RESTART_HOLD_S: the records are gone until each worker's next heartbeat rewrites its
    own, and the workers are still there."""
    counted, run_id, hold_until = 0, None, 0.0
    while True:
        try:
            addresses = [record.address for record in await registry.members()]
            leaving = any(w.address not in addresses for w in pool.workers)
            # The run id is asked once, then only when someone would leave (not every poll).
            now_id = await registry.server_run_id() if leaving or run_id is None else run_id
            if now_id != run_id and run_id is not None:
                log.warning(
                    "the registry at %s restarted: no worker leaves for %g s while they "
                    "register again",
                    registry.url,
                    RESTART_HOLD_S,
                )
                hold_until = pool.clock() + RESTART_HOLD_S
            run_id = now_id
            if pool.clock() < hold_until:
                addresses += [w.address for w in pool.workers if w.address not in addresses]
            await pool.sync(addresses)
            if metrics is not None and registry.refused > counted:
                metrics.registry_refused.inc(registry.refused - counted)
                counted = registry.refused
            if joined is not None:
                joined()
            if synced is not None:
                synced.set()
        except Exception as error:  # Redis away for a moment: keep the last membership
            log.warning("cannot read the registry at %s: %s", registry.url, error)
        await asyncio.sleep(interval_s)
