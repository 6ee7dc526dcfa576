"""Reuse across hosts: this worker serves its host KV pool's blocks to other workers
(`serve`: the ReadPoolBlocks call), and fetches into its own pool what a router says another
worker's pool holds of a prompt (`fetch`: the request's pool_fetch) before its engine computes
the prompt, so that the engine loads those blocks instead (kv_transfer/pool/peer.py moves
and checks them).

A fetch is an optimisation, never a dependency: it is bounded by what computing its tokens
takes here (a fetch slower than that would cost the request time), whatever arrived by then is
kept, and any failure (the source gone, its pool changed, a damaged block, the deadline) is
counted in pdserve_kv_pool_fetch_failures_total and leaves the rest to be computed.
"""

import asyncio
import logging
import time
from itertools import islice

import grpc

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.peer import BlockChunk, BlockWriter, Damaged, read_blocks
from kv_transfer.pool.wire import PEER
from pdserve.core.pool_keys import block_keys
from pdserve.protocol import GRPC_OPTIONS, worker_pb2, worker_pb2_grpc
from pdserve.settings import tls
from pdserve.settings.cluster_secret import secret_metadata

log = logging.getLogger("pdserve.worker")
MIN_FETCH_S = 0.05  # the least a fetch is given: a call's set-up on a fast engine's budget
# The bound before this worker learned what computing a token takes (a fetch of a long history
# through a busy host's gRPC can take seconds; a source that hangs costs this once at most a
# request, until the worker has computed a prompt).
UNLEARNED_FETCH_S = 5.0
FAILURES = {  # the gRPC code a source answers with -> the failure's reason
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.FAILED_PRECONDITION: "refused",  # no pool there, or another namespace
    grpc.StatusCode.UNAUTHENTICATED: "refused",
}


class PoolPeers:
    """`address`: this host's pool; `block_size`, `none_hash`: how a prompt's keys are
    computed (pdserve/worker/pool_contents.py); `stats`: the worker's EngineStats (what
    computing a token takes here, and where fetch times are added up); `metrics`: the
    worker's (None in tests that count nothing)."""

    def __init__(self, address: str, block_size: int, none_hash: bytes, stats, metrics=None):
        self.client = PoolClient(address, PEER)
        self.block_size = block_size
        self.none_hash = none_hash
        self.stats = stats
        self.metrics = metrics
        self._stubs: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerStub]] = {}

    async def serve(self, request: worker_pb2.PoolBlocksRequest, context):
        """The leading blocks of those asked for that this pool holds, as PoolBlockChunks;
        FAILED_PRECONDITION when it holds another namespace's blocks (or none yet)."""
        if not await asyncio.to_thread(self.client.connected):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no KV pool answers here")
        if request.namespace != self.client.pool_namespace:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this pool holds {self.client.pool_namespace}, not {request.namespace}",
            )
        # On this loop, not a thread: a chunk is a copy of at most 4 MiB, and a cancelled call
        # must close the generator (which unpins the blocks) while nothing else runs it.
        chunks = read_blocks(self.client, tuple(request.keys))
        try:
            for chunk in chunks:
                yield worker_pb2.PoolBlockChunk(
                    block=chunk.block, offset=chunk.offset, data=chunk.data, header=chunk.header
                )
        finally:
            chunks.close()  # unpins what was not sent

    async def fetch(self, prompt: list[int], fetch: worker_pb2.PoolFetch) -> int:
        """Fetch the prompt's leading blocks that `fetch.source`'s pool holds and this one
        lacks; the prompt tokens now in this pool because of it."""
        blocks = fetch.tokens // self.block_size
        keys = tuple(islice(block_keys(prompt, self.block_size, self.none_hash), blocks))
        if not keys or not await asyncio.to_thread(self.client.connected):
            return 0
        started = time.monotonic()
        reason, call, writer = "", None, None
        try:
            writer = BlockWriter(self.client, keys)
            if writer.wanted:
                call = self._stub(fetch.source).ReadPoolBlocks(
                    worker_pb2.PoolBlocksRequest(
                        namespace=self.client.pool_namespace, keys=writer.wanted
                    ),
                    timeout=self._budget_s(len(writer.wanted)),
                    metadata=secret_metadata(),
                )
                async for message in call:
                    writer.write(
                        BlockChunk(message.block, message.offset, message.data, message.header)
                    )
                if len(writer.checked) < len(writer.wanted):
                    reason = "evicted"  # the source no longer held them all
        except grpc.aio.AioRpcError as error:
            reason = FAILURES.get(error.code(), "unreachable")
            if reason == "unreachable":  # gone, perhaps for good: a later fetch dials again
                channel, _stub = self._stubs.pop(fetch.source, (None, None))
                if channel is not None:
                    await channel.close()
            log.warning("KV pool fetch from %s: %s: %s", fetch.source, reason, error.details())
        except Damaged as error:
            reason = "damaged"
            log.warning("KV pool fetch from %s: a damaged block (%s)", fetch.source, error)
        except Exception:  # an optimisation's bug must not fail the request: it computes
            reason = "error"
            log.exception("KV pool fetch from %s failed", fetch.source)
        finally:
            if call is not None:
                call.cancel()  # ends the source's stream (and its pins) if it is still open
            fetched = writer.finish() * self.block_size if writer is not None else 0
            self._count(fetched, time.monotonic() - started, reason)
        return fetched

    def _budget_s(self, blocks: int) -> float:
        """A fetch may take as long as computing its tokens here would."""
        per_token = self.stats.step_costs.prefill_s_per_token
        if per_token <= 0:
            return UNLEARNED_FETCH_S
        return max(MIN_FETCH_S, per_token * blocks * self.block_size)

    def _count(self, tokens: int, seconds: float, reason: str) -> None:
        """A fetch's figures; its time counts towards the time per token only when it brought
        some (a fetch that timed out with none cost at most its budget: computing them)."""
        if tokens:
            self.stats.pool_fetch_seconds += seconds
            self.stats.pool_fetched_tokens += tokens
        if self.metrics is not None:
            self.metrics.kv_pool_hits.labels("peer").inc(tokens)
            if reason:
                self.metrics.kv_pool_fetch_failures.labels(reason).inc()

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        if address not in self._stubs:
            channel = tls.aio_channel(address, GRPC_OPTIONS)
            self._stubs[address] = (channel, worker_pb2_grpc.WorkerStub(channel))
        return self._stubs[address][1]

    async def close(self) -> None:
        for channel, _stub in self._stubs.values():
            await channel.close()
        self._stubs.clear()
        self.client.close()
