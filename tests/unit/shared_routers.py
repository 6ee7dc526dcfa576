"""A router's shared parts over fake flex workers, for the tests of what several routers share
in Redis (test_shared_state.py, test_shared_state_security.py)."""

import asyncio

from prometheus_client import CollectorRegistry

from router.shared.state import Peers, SharedState
from router.shared.sync import StateSync
from router.workers.flex_roles import FlexRoles, RoleMetrics
from router.workers.pool import WorkerPool
from router.workers.prefix_index import PrefixIndex
from tests.fakes import FakeWorker


class Router:
    """One router's shared parts: its flex roles over its own pool of fake workers, its prefix
    index, its peer count, and its sync."""

    def __init__(self, url: str, cluster: str, name: str, workers: list[str], auto=False):
        pool = WorkerPool([])
        pool.workers = [FakeWorker(w, "", flex=True, address=w) for w in workers]
        self.roles = FlexRoles(pool, RoleMetrics(CollectorRegistry()))
        self.roles.place_new()
        self.index = PrefixIndex()
        self.peers = Peers()
        self.sync = StateSync(
            SharedState(url, cluster, name), self.roles, self.index, self.peers, auto
        )

    def split(self) -> dict[str, str]:
        return {w.identity.worker_id: w.role for w in self.roles.flex()}

    async def close(self) -> None:
        async with asyncio.timeout(5):
            await self.sync.shared.leave()
            await self.sync.shared.close()
