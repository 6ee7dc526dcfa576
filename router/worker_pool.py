"""The workers the router may send a request to, by role, and the choice among them.

Each worker says its role in Health. Decode and colocated workers take whole requests (and
the decode leg of disaggregated ones); prefill workers take prefill legs. A worker that answered
UNAVAILABLE is skipped until its Health says READY again; with no worker left for a leg the
router answers 503 instead of waiting.
"""

import asyncio
import logging

from cluster.protocol import worker_pb2
from router.errors import worker_unavailable
from router.worker_client import WorkerClient

log = logging.getLogger("pdserve.router")


class WorkerPool:
    def __init__(self, addresses: list[str], policy) -> None:
        self.workers = [WorkerClient(address) for address in addresses]
        self.down: set[str] = set()
        self.policy = policy

    async def wait_ready(self, deadline_s: float) -> None:
        """Wait until every worker is READY, or raise TimeoutError naming the slow ones."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline_s
        pending = list(self.workers)
        while pending:
            pending = [w for w in pending if not await self._is_ready(w)]
            if pending and loop.time() > give_up:
                raise TimeoutError("workers not ready after %.0f s: %s"
                                   % (deadline_s, ", ".join(w.address for w in pending)))
            if pending:
                await asyncio.sleep(0.5)

    async def _is_ready(self, worker: WorkerClient) -> bool:
        try:
            return (await worker.health(timeout=2.0)).state == worker_pb2.HealthReply.READY
        except Exception:  # not listening yet
            return False

    def live(self, roles: tuple[str, ...]) -> list[WorkerClient]:
        return [w for w in self.workers if w.role in roles and w.address not in self.down]

    def pick(self, roles: tuple[str, ...]) -> WorkerClient:
        candidates = self.live(roles)
        if not candidates:
            raise worker_unavailable(f"no {' or '.join(roles)} worker is available; retry later")
        return self.policy.choose(candidates)

    def mark_down(self, worker: WorkerClient) -> None:
        log.warning("worker %s marked down", worker.address)
        self.down.add(worker.address)

    async def refresh(self) -> None:
        """Bring workers back that answer READY again."""
        for worker in self.workers:
            if worker.address in self.down and await self._is_ready(worker):
                log.info("worker %s is back", worker.address)
                self.down.discard(worker.address)

    @property
    def max_model_len(self) -> int:
        return min(w.max_model_len for w in self.workers)

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
