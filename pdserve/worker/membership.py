"""A worker's own entry in the registry: written once its engine is ready, rewritten every
heartbeat with its load, deleted when it drains or stops. If the worker dies, the entry expires
after TTL_HEARTBEATS heartbeats, which is how a dead worker leaves the pools."""

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import replace

from pdserve.protocol.registry import TTL_HEARTBEATS, Registry, WorkerRecord

log = logging.getLogger("pdserve.worker")


def placement_from_environment() -> tuple[str, tuple[str, ...]]:
    """(node, accelerator ids) as the launcher left them: Ray's node id in PDSERVE_NODE, the
    devices this process may use in CUDA_VISIBLE_DEVICES (Ray sets it for each actor)."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return (
        os.environ.get("PDSERVE_NODE") or socket.gethostname(),
        tuple(device for device in devices.split(",") if device),
    )


class WorkerMembership:
    def __init__(
        self, registry: Registry, record: WorkerRecord, heartbeat_s: float, read_load
    ) -> None:
        self.registry = registry
        self.record = record
        self.heartbeat_s = heartbeat_s
        self.read_load = read_load  # () -> its Stats reply's LOAD_FIELDS (registry.recorded_load)
        self._beating: asyncio.Task | None = None

    async def join(self) -> None:
        """Write the entry now (so a failure to reach Redis shows at start), then keep it."""
        await self._write()
        self._beating = asyncio.create_task(self._beat())
        log.info(
            "joined the %s pool in %s as %s",
            self.record.identity.role,
            self.registry.url,
            self.record.identity.worker_id,
        )

    async def _write(self) -> None:
        record = replace(self.record, load=self.read_load())
        await self.registry.put(record, TTL_HEARTBEATS * self.heartbeat_s)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._write()
            except Exception as error:  # Redis away: the entry may expire; keep trying
                log.warning("heartbeat to %s failed: %s", self.registry.url, error)

    async def leave(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
            self._beating = None
        try:
            await self.registry.remove(self.record.identity.worker_id)
            log.info("left the %s pool", self.record.identity.role)
        except Exception as error:  # the entry expires on its own
            log.warning(
                "could not remove %s from the registry: %s", self.record.identity.worker_id, error
            )
