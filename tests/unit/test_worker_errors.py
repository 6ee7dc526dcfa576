"""A request the engine ended with an error reaches the client as what it was: on a decode leg
whose KV did not come, kv_transfer_failed; otherwise (the engine's own failure, a prefill leg's
included) worker_error. The worker's real status choice (WorkerService) answers over gRPC on
127.0.0.1 to the router's real WorkerClient; only the engine is left out."""

import asyncio

import grpc
import pytest

from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.worker.service import WorkerService
from pdserve.worker.session import RequestFailed
from router.flow.accounting import Accounting
from router.http.errors import OpenAIError
from router.metrics import RouterMetrics
from router.workers.client import WorkerClient


class EngineEndsWithError(WorkerService):
    """A worker whose engine ends every request with finish_reason "error"."""

    async def run(self, request, trace_headers):
        raise RequestFailed(*self._error_status(request))
        yield  # a stream of chunks


async def generate_error(request: worker_pb2.GenerateRequest) -> OpenAIError:
    server = grpc.aio.server()
    service = EngineEndsWithError("decode-a", "decode", "m", kv_failure_policy="fail")
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(OpenAIError) as caught:
            async for _ in client.generate(request, timeout=10):
                pass
        return caught.value
    finally:
        await client.close()
        await server.stop(None)


@pytest.mark.parametrize(
    "kv, kind",
    [
        (worker_pb2.KvTransfer(transfer_id="t", receive_timeout_s=2), "kv_transfer_failed"),
        (worker_pb2.KvTransfer(transfer_id="t", send_to="127.0.0.1:1"), "worker_error"),
        (None, "worker_error"),
    ],
    ids=["decode-leg", "prefill-leg", "local"],
)
def test_an_engine_error_is_a_kv_failure_only_on_a_decode_leg(kv, kind):
    request = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2])
    if kv is not None:
        request.kv.CopyFrom(kv)
    error = asyncio.run(generate_error(request))
    assert (error.status, error.kind, error.code) == (502, kind, kind)
    metrics = RouterMetrics()
    Accounting(metrics).error(error, "completions")
    assert metrics.registry.get_sample_value("pdserve_errors_total", {"kind": kind}) == 1
    if kind == "kv_transfer_failed":
        assert "did not arrive within 2 s" in error.message and "'fail'" in error.message


class StreamsUntilStopped(WorkerService):
    """A worker whose engine sends one token and then runs until the server stops; or, with
    `cancels`, whose stream then ends CANCELLED (a stopping worker's, seen in a CI run)."""

    cancels = False

    async def run(self, request, trace_headers):
        yield worker_pb2.GenerateChunk(token_ids=[7])
        if self.cancels:
            raise RequestFailed(grpc.StatusCode.CANCELLED, "CANCELLED")
        await asyncio.sleep(60)


async def error_of_a_stream_the_worker_ends(cancels: bool) -> OpenAIError:
    server = grpc.aio.server()
    service = StreamsUntilStopped("decode-a", "decode", "m")
    service.cancels = cancels
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    request = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2])
    try:
        with pytest.raises(OpenAIError) as caught:
            async for _ in client.generate(request, timeout=10):
                if not cancels:
                    await server.stop(grace=0.1)  # the worker stops, as on SIGTERM, mid-stream
        return caught.value
    finally:
        await client.close()
        await server.stop(None)


@pytest.mark.parametrize("cancels", [False, True], ids=["server-stopped", "stream-cancelled"])
def test_a_stream_the_worker_ends_unasked_is_the_worker_unavailable(cancels):
    """A stream the router did not cancel, ended by the worker (UNAVAILABLE when its server
    stops; CANCELLED) is the worker going away: the router migrates it, never a 502."""
    error = asyncio.run(error_of_a_stream_the_worker_ends(cancels))
    assert (error.status, error.kind) == (503, "worker_unavailable"), error.message


def test_a_cancel_after_the_worker_left_the_pool_ends_quietly():
    """A transfer cancelled after its decode worker left the pools (its channel closed) is best
    effort: grpc refuses a closed channel with UsageError, which once escaped the caller."""

    async def after_close():
        client = WorkerClient("127.0.0.1:1")
        assert client.stub is not None  # its channel, made
        await client.close()
        await client.cancel_transfer("t", "gone")

    asyncio.run(after_close())
