"""The worker port's unauthenticated surface is bounded (security review 2026-12, H1 and L9):
grpc.health.v1 `Watch`, which the secret gate lets through, runs MAX_WATCHES at once for
WATCH_MAX_S at most (probes use Check, which still answers), and calls refused for want of the
cluster secret are logged once per interval. A real grpc.aio server on loopback."""

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.protocol import worker_pb2
from pdserve.worker import grpc_health
from pdserve.worker.grpc_health import MAX_WATCHES, add_health
from pdserve.worker.secret_check import SecretCheck

READY = SimpleNamespace(state=worker_pb2.HealthReply.READY)  # the worker service's state


async def serving(interceptors=()):
    server = grpc.aio.server(interceptors=list(interceptors))
    add_health(server, READY)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_at_most_max_watches_run_and_check_still_answers():
    async def go():
        server, address = await serving()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(MAX_WATCHES)]
                for watch in watches:  # each is running: it sent the status
                    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                extra = stub.Watch(health_pb2.HealthCheckRequest())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await extra.read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                check = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                watches[0].cancel()
                await asyncio.sleep(0.2)
                again = stub.Watch(health_pb2.HealthCheckRequest())
                assert (await again.read()).status == health_pb2.HealthCheckResponse.SERVING
                for watch in [*watches, again]:
                    watch.cancel()
        finally:
            await server.stop(None)

    asyncio.run(go())


def test_a_watch_ends_by_itself(monkeypatch):
    monkeypatch.setattr(grpc_health, "WATCH_MAX_S", 0.3)

    async def go():
        server, address = await serving()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                statuses = [reply.status async for reply in watch]
                assert statuses == [health_pb2.HealthCheckResponse.SERVING]
                assert await watch.code() == grpc.StatusCode.OK
        finally:
            await server.stop(None)

    asyncio.run(go())


def test_calls_without_the_secret_are_logged_once_per_interval(caplog):
    async def go():
        server, address = await serving([SecretCheck("the cluster's")])
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(20):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(None)

    with caplog.at_level(logging.INFO, "pdserve.worker"):
        asyncio.run(go())
    refusals = [r for r in caplog.records if "without this cluster's secret" in r.getMessage()]
    assert len(refusals) == 1
