"""What the router needs of a worker, as a Protocol: router/workers/client.py's WorkerClient is
the real one (a gRPC channel to a worker process); the router's unit tests give one fake
(tests/fakes.py) that this same Protocol checks."""

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Protocol

from pdserve.protocol import worker_pb2
from router.workers.load import WorkerLoad


class WorkerHandle(Protocol):
    address: str
    role: str  # the pool it serves: its own, or the one the router gave a flex worker
    flex: bool
    identity: worker_pb2.HealthReply  # who it is, as its Health said: how its KV moves, ...
    # what it runs now
    users: int
    load: WorkerLoad

    async def health(self, timeout: float = ...) -> worker_pb2.HealthReply: ...

    async def stats(
        self, request: worker_pb2.StatsRequest | None = None, timeout: float = ...
    ) -> worker_pb2.StatsReply: ...

    def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float
    ) -> AsyncIterator[worker_pb2.GenerateChunk]: ...

    async def cancel_transfer(self, transfer_id: str, reason: str) -> None: ...

    def in_use(self) -> AbstractContextManager: ...

    async def close(self) -> None: ...
