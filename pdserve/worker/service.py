"""The worker's gRPC service: runs requests on the vLLM engine and reports load.

The gRPC server starts before the engine (which takes ~30 s on CPU), so Health can answer
STARTING meanwhile. A request runs the same way from a Generate call or a router's Session
(pdserve/worker/session.py); a cancelled call or an aborted stream closes vLLM's generator,
which aborts the request inside the engine and frees its KV blocks.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from pdserve.core import tracing
from pdserve.core.fan_out import fan_out
from pdserve.core.kinds import AUTO_TRANSPORT, Transport
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.protocol.data_parallel import kv_receivers
from pdserve.protocol.status import ENGINE_FAILED, KV_TRANSFER_FAILED
from pdserve.settings import json_logs
from pdserve.worker.chunks import to_chunk
from pdserve.worker.engine_stats import EngineStats
from pdserve.worker.pool_contents import PoolContentsSource
from pdserve.worker.pool_peers import PoolPeers
from pdserve.worker.sampling import choice_count, to_vllm_sampling
from pdserve.worker.session import RequestFailed, ServesSessions

State = worker_pb2.HealthReply.State
PROBE_SAMPLING = worker_pb2.SamplingParams(max_tokens=1, temperature=0, top_p=1)
DRAIN_POLL_S = 0.2
CANCEL_TIMEOUT_S = 5.0  # a CancelTransfer call without a deadline gets this one
log = logging.getLogger("pdserve.worker")


async def _nothing_to_leave() -> None:
    """A worker outside any registry (`pdserve serve`) is in no pool to leave."""


def kv_extra_args(request: worker_pb2.GenerateRequest) -> dict | None:
    """The request's KV transfer, as the connector reads it from vLLM's extra_args."""
    from kv_transfer.params import ReceiveKv, SendKv, to_extra_args

    if not request.HasField("kv"):
        return None
    kv = request.kv
    peer_tp = kv.peer_tensor_parallel_size or 1
    if kv.send_to:
        return to_extra_args(
            SendKv(
                kv.transfer_id,
                kv.send_to,
                peer_tp,
                kv.transport or Transport.GRPC,
                kv.skip_tokens,
                kv.peer_data_parallel_rank,
            )
        )
    return to_extra_args(
        ReceiveKv(
            kv.transfer_id,
            kv.receive_timeout_s,
            kv.kv_tokens or len(request.prompt_token_ids),
            peer_tp,
            kv.skip_tokens,
        )
    )


class WorkerService(ServesSessions, worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        worker_id: str,
        role: str,
        model: str,
        kv_address: str = "",
        kv_failure_policy: str = "",
        kv_transport: str = AUTO_TRANSPORT,
        kv_pool: str = "",
        metrics=None,
    ) -> None:
        from kv_transfer.transport import host_id

        # Who it is (the Health reply less its state and message): what its settings say
        # now, completed once by engine_ready; the router and the registry keep it whole.
        self.identity = worker_pb2.HealthReply(
            worker_id=worker_id,
            role=role,
            model=model,
            kv_address=kv_address,
            kv_failure_policy=kv_failure_policy,
            kv_transport=kv_transport,
            kv_pool=kv_pool,  # the host KV pool's address, if its engine uses one
            host_id=host_id(),
        )
        self.pool_contents: PoolContentsSource | None = None  # once the engine runs
        self.pool_peers: PoolPeers | None = None  # ... and the routers can name its blocks
        self.metrics = metrics  # the worker's Prometheus series (None: tests that count none)
        self.engine = None
        self.engine_stats = EngineStats()
        self.state = State.STARTING
        self.state_message = "engine starting"
        self.kv_blocks_total = 0
        self.active: dict[str, list[str]] = {}  # request id -> its engine requests' ids
        self.awaiting_first_token: dict[str, int] = {}  # request id -> prompt tokens to compute
        self.rank_running: list[int] = [0]  # requests in flight on each data-parallel rank
        self.leave_pools = _nothing_to_leave  # set when the worker is in a registry

    def engine_ready(self, engine) -> None:
        from kv_transfer.compatibility import compatibility_of

        config = engine.vllm_config
        parallel = config.parallel_config
        # A group's node serves its own ranks only (vLLM's input processor checks alike).
        ranks = (
            parallel.data_parallel_size_local
            if parallel.local_engines_only
            else parallel.data_parallel_size
        )
        self.engine = engine
        self.kv_blocks_total = (config.cache_config.num_gpu_blocks or 0) * ranks
        self.rank_running = [0] * ranks
        self.identity.MergeFrom(
            worker_pb2.HealthReply(
                max_model_len=config.model_config.max_model_len,
                tensor_parallel_size=parallel.tensor_parallel_size,
                device=config.device_config.device_type,
                max_num_seqs=config.scheduler_config.max_num_seqs * ranks,
                kv_compatibility=compatibility_of(config).fingerprint(),
                data_parallel_ranks=ranks,
            )
        )
        kv_pool = self.identity.kv_pool
        if kv_pool:
            self.pool_contents = PoolContentsSource.of_engine(kv_pool, config)
        if self.pool_contents is not None:
            source = self.pool_contents
            self.pool_peers = PoolPeers(
                kv_pool, source.block_size, source.none_hash, self.engine_stats, self.metrics
            )
        self.state, self.state_message = State.READY, ""

    def engine_failed(self, message: str) -> None:
        self.state, self.state_message = State.FAILED, message

    async def Generate(self, request, context):
        """One request, its chunks streamed (the router sends its requests over Session)."""
        try:
            async with contextlib.aclosing(
                self.run(request, dict(context.invocation_metadata() or ()))
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        except RequestFailed as failed:
            await context.abort(failed.code, failed.details)

    async def run(
        self, request: worker_pb2.GenerateRequest, trace_headers: dict[str, str]
    ) -> AsyncIterator[worker_pb2.GenerateChunk]:
        """Runs one request on the engine: its chunks, or RequestFailed. Leaving early (the
        generator closed: a cancelled call, an aborted stream) aborts it in the engine."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        json_logs.request_id.set(request.request_id)  # on every line logged for it
        if self.state not in (State.READY, State.DRAINING):
            raise RequestFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self.identity.worker_id} is not ready: {self.state_message}",
            )
        self._validate(request)
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.cache_salt:  # only requests of one salt share the engine's cached blocks
            prompt["cache_salt"] = request.cache_salt
        request_id = request.request_id
        span = tracing.tracer().start_span(
            "pdserve.worker.generate",
            context=tracing.joined(trace_headers),
            kind=trace.SpanKind.SERVER,
            attributes={"pdserve.worker": self.identity.worker_id, "pdserve.leg": _leg(request)},
        )
        trace_headers = tracing.trace_headers(span) or None  # vLLM's request span: a child
        choices = choice_count(request.sampling)
        engine_ids = [request_id]  # one engine request per choice
        if choices > 1:
            engine_ids = [f"{request_id}-c{i}" for i in range(choices)]
        self.active[request_id] = engine_ids
        self.awaiting_first_token[request_id] = _tokens_to_compute(request)
        rank = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        if rank is not None:
            self.rank_running[rank] += 1
        try:
            if request.HasField("pool_fetch") and self.pool_peers is not None:
                await self.pool_peers.fetch(prompt["prompt_token_ids"], request.pool_fetch)
            samplings = [
                to_vllm_sampling(request.sampling, kv_extra_args(request) if i == 0 else None, i)
                for i in range(choices)
            ]
            streams = [
                functools.partial(
                    self.engine.generate,
                    prompt,
                    sampling,
                    engine_id,
                    trace_headers=trace_headers,
                    data_parallel_rank=rank,
                )
                for sampling, engine_id in zip(samplings, engine_ids, strict=True)
            ]
            async with contextlib.aclosing(fan_out(streams)) as outputs:
                async for choice, output in outputs:
                    self.awaiting_first_token.pop(request_id, None)
                    if output.outputs[0].finish_reason == "error":
                        raise RequestFailed(*self._error_status(request))
                    yield self._chunk(output, choice, request)
        except (VLLMClientError, ValueError) as error:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        except EngineDeadError as error:
            self.engine_failed(f"engine died: {error}")
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, self.state_message) from None
        finally:
            self.active.pop(request_id, None)
            self.awaiting_first_token.pop(request_id, None)
            if rank is not None:
                self.rank_running[rank] -= 1
            span.end()

    def _error_status(self, request) -> tuple[grpc.StatusCode, str]:
        """Why the engine ended a request with an error: on a decode leg, its KV did not come
        (the `fail` policy); otherwise the engine's own failure. Distinct codes, so that the
        router reports each as what it is."""
        if request.HasField("kv") and not request.kv.send_to:
            return KV_TRANSFER_FAILED, (
                f"the prompt's KV did not arrive within {request.kv.receive_timeout_s:g} s, or "
                f"failed its integrity check (transfer {request.kv.transfer_id}); this worker's "
                f"kv failure policy is '{self.identity.kv_failure_policy}'"
            )
        return ENGINE_FAILED, "the engine ended the request with an error"

    def _validate(self, request) -> None:
        if not request.request_id:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if request.request_id in self.active:
            raise RequestFailed(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} is already running"
            )
        if not request.prompt_token_ids:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        ranks = len(self.rank_running)
        if request.HasField("data_parallel_rank") and request.data_parallel_rank >= ranks:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"data_parallel_rank {request.data_parallel_rank}: this worker runs {ranks}",
            )
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        context_length = self.identity.max_model_len
        if total > context_length:
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(request.prompt_token_ids)} tokens) plus max_tokens "
                f"({request.sampling.max_tokens}) exceeds the context length {context_length}",
            )

    def _chunk(self, output, choice: int, request) -> worker_pb2.GenerateChunk:
        chunk = to_chunk(output, choice)
        if not output.finished or choice != 0:  # the first choice took the KV transfer
            return chunk
        if request.HasField("kv") and not request.kv.send_to:
            transfer = self.engine_stats.take_kv_transfer(request.kv.transfer_id)
            if transfer is not None:
                chunk.kv.CopyFrom(
                    worker_pb2.KvTransferStats(
                        bytes=transfer.bytes,
                        seconds=transfer.seconds,
                        failed=transfer.failed,
                        failure=transfer.failure or "",
                        transport=transfer.transport,
                    )
                )
        return chunk

    async def _probe(self) -> None:
        """One 1-token request: an engine step, after which vLLM reports its scheduler stats."""
        probe = {"prompt_token_ids": [0]}
        async for _ in self.engine.generate(
            probe, to_vllm_sampling(PROBE_SAMPLING), f"stats-probe-{time.monotonic_ns()}"
        ):
            pass

    async def Abort(self, request, context):
        engine_ids = self.active.get(request.request_id)
        if engine_ids:
            await self.engine.abort(engine_ids)
        was_running = engine_ids is not None
        return worker_pb2.AbortReply(was_running=was_running)

    async def CancelTransfer(self, request, context):
        """Tell each of this worker's KV receiver ranks that a transfer's KV will not come
        (its prefill leg failed), so that the waiting request's policy applies at once; within
        the call's deadline. UNAVAILABLE when a rank could not be told: the request's own KV
        deadline still applies."""
        from kv_transfer.grpc_transport import cancel_transfer
        from kv_transfer.transfer_report import Cancel, Failure

        if not self.identity.kv_address:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {self.identity.worker_id} receives no KV",
            )
        ranks = kv_receivers(
            self.identity.data_parallel_ranks, self.identity.tensor_parallel_size or 1
        )
        per_rank_s = (context.time_remaining() or CANCEL_TIMEOUT_S) / ranks
        try:
            await asyncio.to_thread(
                cancel_transfer,
                self.identity.kv_address,
                request.transfer_id,
                Cancel(Failure.CANCELLED, request.reason),
                ranks,
                per_rank_s,
            )
        except grpc.RpcError as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"could not cancel transfer {request.transfer_id}: {error.code().name}: "
                f"{error.details()}",
            )
        return worker_pb2.CancelTransferReply()

    async def ReadPoolBlocks(self, request, context):
        """Another worker fetching a prompt's prefix from this host's KV pool."""
        if self.pool_peers is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {self.identity.worker_id} has no KV pool",
            )
        async for chunk in self.pool_peers.serve(request, context):
            yield chunk

    async def Health(self, request, context):
        reply = worker_pb2.HealthReply()
        reply.CopyFrom(self.identity)
        reply.state, reply.message = self.state, self.state_message
        return reply

    async def Stats(self, request, context):
        if request.fresh and self.engine is not None:
            await self._probe()
        reply = self.stats_reply()
        if request.kv_pool_contents and self.pool_contents is not None:
            contents = await asyncio.to_thread(
                self.pool_contents.changes, request.kv_pool_store_id, request.kv_pool_since
            )
            if contents is not None:
                reply.kv_pool_contents.CopyFrom(contents)
        return reply

    def stats_reply(self) -> worker_pb2.StatsReply:
        running = self.engine.get_num_unfinished_requests() if self.engine is not None else 0
        stats = self.engine_stats
        costs = stats.step_costs.costs()
        return worker_pb2.StatsReply(
            worker_id=self.identity.worker_id,
            running_requests=running,
            waiting_requests=min(stats.waiting, running),
            kv_blocks_used=round(stats.kv_cache_usage * self.kv_blocks_total),
            kv_blocks_total=self.kv_blocks_total,
            outstanding_prefill_tokens=sum(self.awaiting_first_token.values()),
            prefilling_requests=len(self.awaiting_first_token),
            prefill_seconds_per_token=costs.prefill_s_per_token,
            decode_step_base_seconds=costs.decode_base_s,
            decode_step_seconds_per_sequence=costs.decode_s_per_sequence,
            kv_pool_load_seconds_per_token=stats.pool_load_seconds_per_token(),
            kv_pool_fetch_seconds_per_token=stats.pool_fetch_seconds_per_token(),
            data_parallel_running=self.rank_running if len(self.rank_running) > 1 else (),
        )

    async def Drain(self, request, context):
        started = time.monotonic()
        if self.state == State.READY:
            self.state, self.state_message = State.DRAINING, "draining: left the pools"
        await self.leave_pools()
        await asyncio.sleep(request.grace_seconds)
        deadline = started + request.timeout_seconds
        idle = await self._idle()
        while not idle and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
            idle = await self._idle()
        left = len(self.active)
        log.info("drained in %.1f s, %d request(s) left", time.monotonic() - started, left)
        return worker_pb2.DrainReply(
            drained=idle, requests_left=left, seconds=time.monotonic() - started
        )

    async def _idle(self) -> bool:
        """No request in flight, and no KV block held (a prefill worker holds a request's
        blocks until its KV is sent)."""
        if self.active or self.engine is None:
            return not self.active
        await self._probe()
        return self.stats_reply().kv_blocks_used == 0


def _tokens_to_compute(request: worker_pb2.GenerateRequest) -> int:
    """The prompt tokens this worker computes: none of those whose KV a prefill worker sends
    (a decode leg: all of the prompt, or its first kv_tokens when it goes on from the prefill's
    first token)."""
    prompt = len(request.prompt_token_ids)
    if request.HasField("kv") and not request.kv.send_to:
        return prompt - request.kv.kv_tokens if request.kv.kv_tokens else 0
    return prompt


def _leg(request) -> str:
    """Which part of a request this call is: a prefill leg sends its KV, a decode leg receives
    it, a whole request does neither."""
    if not request.HasField("kv"):
        return "whole"
    return "prefill" if request.kv.send_to else "decode"
