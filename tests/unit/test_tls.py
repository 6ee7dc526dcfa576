"""Mutual TLS on the cluster's gRPC channels (pdserve/settings/tls.py), on loopback with
certificates
made by scripts/make_tls_dir.py: the real worker service and the real KV receiver and gRPC KV
sender. A member of the cluster gets through; a plaintext client, or one whose certificate
another CA signed, does not."""

import asyncio
import os
import runpy
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.channels import kv_sender
from kv_transfer.compatibility import Compatibility
from kv_transfer.host_staging import Staged
from kv_transfer.kv_layout import WIRE_LAYOUT
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.transport import LayerSlice
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings import tls
from pdserve.settings.base import ConfigError
from pdserve.worker.command import stop_serving
from pdserve.worker.grpc_health import add_health, serve_health_alone
from pdserve.worker.processes import free_port
from pdserve.worker.service import WorkerService

SCRIPT = Path(__file__).parents[2] / "scripts" / "make_tls_dir.py"
CONSUMER = Compatibility("m", "float32", 16, 2, 2, 4, WIRE_LAYOUT, "0.32.0", 32, "none")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two members of the cluster, and a stranger whose CA is another one."""
    make = runpy.run_path(str(SCRIPT))["make_tls_dirs"]
    root = tmp_path_factory.mktemp("tls")
    server, client = make(root / "cluster", members=2)
    (stranger,) = make(root / "elsewhere", members=1)
    return {"server": server, "client": client, "stranger": stranger}


def as_member(monkeypatch, folder: Path | None) -> None:
    if folder is None:
        monkeypatch.delenv(tls.TLS_DIR_ENV, raising=False)
    else:
        monkeypatch.setenv(tls.TLS_DIR_ENV, str(folder))


async def health_codes(monkeypatch, folders, clients) -> list[grpc.StatusCode]:
    as_member(monkeypatch, folders["server"])
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService("w", "decode", "m"), server)
    port = tls.add_port(server, "127.0.0.1:0")
    await server.start()
    codes = []
    try:
        for client in clients:
            as_member(monkeypatch, client and folders[client])
            async with tls.aio_channel(f"127.0.0.1:{port}") as channel:
                try:
                    await worker_pb2_grpc.WorkerStub(channel).Health(
                        worker_pb2.HealthRequest(), timeout=5
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
    finally:
        await server.stop(grace=None)
    return codes


def test_only_a_member_reaches_a_worker_over_tls(monkeypatch, folders):
    codes = asyncio.run(health_codes(monkeypatch, folders, ["client", None, "stranger"]))
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAVAILABLE,  # plaintext to a TLS port: no connection
        grpc.StatusCode.UNAVAILABLE,  # its certificate is not the cluster CA's
    ]


def test_only_a_member_pushes_kv_over_tls(monkeypatch, folders):
    as_member(monkeypatch, folders["server"])
    receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    arrived = {}
    try:
        for who in ("stranger", None, "client"):
            as_member(monkeypatch, who and folders[who])
            sender = kv_sender(CONSUMER, "127.0.0.1", torch.device("cpu"))
            data = torch.ones(64, dtype=torch.uint8)
            sender.send(
                address, "grpc", LayerSlice(f"from-{who}", 0, 0, 1, 0, 2, Staged(data, 64), True)
            )
            deadline = time.monotonic() + 10
            got = []
            while not got and time.monotonic() < deadline and who == "client":
                got = receiver.take()[0]
                time.sleep(0.02)
            sender.close()
            arrived[who] = [piece.transfer_id for piece in got or receiver.take()[0]]
            for piece in got:
                piece.release()
    finally:
        receiver.stop()
    assert arrived == {"stranger": [], None: [], "client": ["from-client"]}


def test_a_tls_dir_missing_a_file_is_a_config_error(tmp_path, folders):
    (tmp_path / "ca.pem").write_bytes((folders["client"] / "ca.pem").read_bytes())
    with pytest.raises(ConfigError, match="missing cert.pem, key.pem"):
        tls.load_tls_dir(str(tmp_path))


async def plaintext_calls(monkeypatch, folders) -> dict[str, object]:
    """A worker whose gRPC port has TLS, with --health-port: what a plaintext client (a kubelet
    probe) gets from each port."""
    as_member(monkeypatch, folders["server"])
    service = WorkerService("w", "decode", "m")
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    add_health(server, service)
    port = tls.add_port(server, "127.0.0.1:0")
    await server.start()
    health_port = free_port()
    health = await serve_health_alone(service, f"127.0.0.1:{health_port}")
    as_member(monkeypatch, None)
    seen = {}
    try:
        for name, target in (("tls", port), ("health", health_port)):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{target}") as channel:
                check = health_pb2_grpc.HealthStub(channel).Check
                stats = worker_pb2_grpc.WorkerStub(channel).Stats
                for call, request in (
                    (check, health_pb2.HealthCheckRequest(service="liveness")),
                    (stats, worker_pb2.StatsRequest()),
                ):
                    try:
                        reply = await call(request, timeout=5)
                        seen[name, call is check] = reply.status if call is check else "answered"
                    except grpc.aio.AioRpcError as error:
                        seen[name, call is check] = error.code()
    finally:
        await stop_serving(server, service, health, grace=0)
    return seen


def test_the_health_port_answers_probes_in_plaintext_and_nothing_else(monkeypatch, folders):
    seen = asyncio.run(plaintext_calls(monkeypatch, folders))
    assert seen == {
        ("tls", True): grpc.StatusCode.UNAVAILABLE,  # the probe cannot speak TLS
        ("tls", False): grpc.StatusCode.UNAVAILABLE,
        ("health", True): health_pb2.HealthCheckResponse.SERVING,  # STARTING is alive
        ("health", False): grpc.StatusCode.UNIMPLEMENTED,  # no worker call in plaintext
    }


def test_private_keys_are_never_readable_by_others(tmp_path, monkeypatch):
    """Made 0600 from their creation (review L2: a write then a chmod left a window), also when
    made again over an older one."""
    make = runpy.run_path(str(SCRIPT))["make_tls_dirs"]
    make(tmp_path, members=1)
    modes = []
    real_open = os.open

    def recording_open(path, flags, mode=0o777):
        modes.append(mode)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", recording_open)
    (again,) = make(tmp_path, members=1)
    assert modes and set(modes) == {0o600}
    for key in (again / "key.pem", tmp_path / "ca-key.pem"):
        assert key.stat().st_mode & 0o777 == 0o600
