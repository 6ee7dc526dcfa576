"""The fake worker scripts/bench_router.py measures the router with: over real gRPC on 127.0.0.1,
the router's own client finds it READY and streams exactly max_tokens tokens from it, the last
chunk finished, one a tick of the interval it was given."""

import asyncio
import time

import grpc

from pdserve.bench.fake_worker import FakeWorker
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from router.workers.client import WorkerClient


async def stream_from_a_fake(max_tokens: int, interval_s: float):
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(FakeWorker("fake-0", interval_s), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        health = await client.health()
        request = worker_pb2.GenerateRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            sampling=worker_pb2.SamplingParams(max_tokens=max_tokens),
        )
        began = time.perf_counter()
        chunks = [chunk async for chunk in client.generate(request, timeout=10)]
        return health, chunks, time.perf_counter() - began
    finally:
        await client.close()
        await server.stop(None)


def test_the_fake_streams_max_tokens_at_its_interval():
    health, chunks, seconds = asyncio.run(stream_from_a_fake(5, 0.05))
    assert (health.state, health.role) == (worker_pb2.HealthReply.READY, "colocated")
    assert [len(c.token_ids) for c in chunks] == [1] * 5
    assert [c.finish_reason for c in chunks] == ["", "", "", "", "length"]
    assert chunks[0].prompt_tokens == 3
    assert 0.2 <= seconds < 2  # five ticks: at least four intervals
