"""CancelTransfer: the router tells a decode worker that a transfer's KV will not come, and the
worker tells its KV receiver (the router no longer reaches the data plane itself). A real
WorkerService and KvReceiver on 127.0.0.1, called by the router's real WorkerClient."""

import asyncio
import contextlib
import logging
import socket
import time

import grpc
import pytest

from kv_transfer.compatibility import Compatibility
from kv_transfer.kv_layout import WIRE_LAYOUT
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.transfer_report import Cancel, Failure
from pdserve.protocol import worker_pb2_grpc
from pdserve.worker.service import WorkerService
from router.workers.client import WorkerClient

CONSUMER = Compatibility("m", "float32", 16, 2, 2, 4, WIRE_LAYOUT, "0.32.0", 32, "none")


@pytest.fixture
def kv_address():
    receiver = KvReceiver(CONSUMER)
    port = receiver.start("127.0.0.1", 0)
    yield receiver, f"127.0.0.1:{port}"
    receiver.stop()


async def cancel_on(service: WorkerService, transfer_id: str) -> float:
    """Serve `service`, cancel `transfer_id` through it; returns the seconds the call took."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        started = time.monotonic()
        await client.cancel_transfer(transfer_id, "prefill worker failed: gone")
        return time.monotonic() - started
    finally:
        await client.close()
        await server.stop(None)


def decode_service(kv_address: str) -> WorkerService:
    service = WorkerService("decode-a", "decode", "m", kv_address=kv_address)
    service.identity.tensor_parallel_size = 1
    return service


def test_the_decode_workers_receiver_learns_the_transfer_is_cancelled(kv_address):
    receiver, address = kv_address
    asyncio.run(cancel_on(decode_service(address), "cmpl-1"))
    _, cancelled = receiver.take()
    assert cancelled == {"cmpl-1": Cancel(Failure.CANCELLED, "prefill worker failed: gone")}


def test_an_unreachable_receiver_is_logged_within_the_deadline_not_raised(caplog):
    with contextlib.closing(socket.socket()) as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening
        with caplog.at_level(logging.WARNING, "pdserve.router"):
            seconds = asyncio.run(cancel_on(decode_service(address), "cmpl-2"))
    assert seconds < 10
    assert "could not cancel transfer cmpl-2" in caplog.text
    assert "UNAVAILABLE" in caplog.text


def test_a_worker_that_receives_no_kv_says_so(caplog):
    with caplog.at_level(logging.WARNING, "pdserve.router"):
        asyncio.run(cancel_on(WorkerService("prefill-a", "prefill", "m"), "cmpl-3"))
    assert "FAILED_PRECONDITION" in caplog.text and "receives no KV" in caplog.text
