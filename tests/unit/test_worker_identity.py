"""A worker's identity (its Health reply less the state and message) is kept whole at every hop:
the worker's WorkerService answers it with its state over gRPC on 127.0.0.1, the router's real
WorkerClient keeps the READY reply, and the registry record carries it; only the engine is left
out (what engine_ready adds is set by hand)."""

import asyncio

import grpc

from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.protocol.registry import WorkerRecord
from pdserve.worker.service import State, WorkerService
from router.workers.client import WorkerClient


async def identities_seen() -> tuple[WorkerService, list[worker_pb2.HealthReply], WorkerClient]:
    """The client's identity while the worker starts, then once it is ready."""
    service = WorkerService("decode-a", "decode", "m", kv_address="h:7", kv_failure_policy="fail")
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    seen = []
    try:
        starting = await client.health()
        assert (starting.state, starting.message) == (State.STARTING, "engine starting")
        assert starting.worker_id == "decode-a" and starting.kv_address == "h:7"
        seen.append(client.identity)
        service.identity.MergeFrom(  # as engine_ready does
            worker_pb2.HealthReply(max_model_len=2048, max_num_seqs=8, kv_compatibility="fp")
        )
        service.state, service.state_message = State.READY, ""
        assert (await client.health()).state == State.READY
        seen.append(client.identity)
    finally:
        await client.close()
        await server.stop(None)
    return service, seen, client


def test_the_router_keeps_the_identity_the_worker_answers_once_it_is_ready():
    service, (while_starting, once_ready), client = asyncio.run(identities_seen())
    assert while_starting == worker_pb2.HealthReply(worker_id=client.address)
    assert once_ready == worker_pb2.HealthReply(
        state=State.READY,
        worker_id="decode-a",
        role="decode",
        model="m",
        kv_address="h:7",
        kv_failure_policy="fail",
        kv_transport=service.identity.kv_transport,
        host_id=service.identity.host_id,
        max_model_len=2048,
        max_num_seqs=8,
        kv_compatibility="fp",
    )
    assert client.role == "decode" and not client.flex
    assert service.identity.state == State.STARTING  # the worker's own identity has no state


def test_a_registry_record_carries_the_workers_identity_whole():
    identity = worker_pb2.HealthReply(
        worker_id="decode-a", role="decode", kv_address="h:7", kv_compatibility="fp", device="cpu"
    )
    written = WorkerRecord(identity, "h:50051", "node-1", ("0",))
    assert WorkerRecord.from_json(written.to_json()) == written
