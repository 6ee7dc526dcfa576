"""What a peer that has proved nothing can hold on a decode rank's KV receiver (security review
2026-12, H1 and L9): the real receiver on 127.0.0.1 with a cluster secret, attacked the way
reproductions/poc_kv_preauth.py does. gRPC: streams that never say hello end within
HELLO_WAIT_S, they never keep a sender's stream or a control call out, accepted streams are
bounded. shm: a connection from another user is closed at accept, a frame above
MAX_FRAME_BYTES closes it, descriptors sent before a hello are closed as they come (and refuse
the hello), connections are bounded. Refusals are logged once per kind per interval."""

import logging
import os
import socket
import struct
import threading
import time

import grpc
import pytest
import torch

from kv_transfer import kv_receiver as kv_receiver_module
from kv_transfer import kv_wire_pb2 as wire
from kv_transfer import kv_wire_pb2_grpc as wire_grpc
from kv_transfer import shm_transport
from kv_transfer.channels import kv_sender
from kv_transfer.grpc_transport import handshake, hello
from kv_transfer.kv_receiver import HELLO_STREAMS, HELLO_WAIT_S, MAX_STREAMS, KvReceiver
from kv_transfer.shm_transport import MAX_FRAME_BYTES, FrameReader, send_frame, socket_name
from pdserve.settings.cluster_secret import SECRET_ENV
from tests.unit.kv_endpoints import CONSUMER, another_users_peer, piece, take_until

CPU = torch.device("cpu")


@pytest.fixture
def guarded(monkeypatch):
    """A receiver whose cluster has a secret (this process's senders carry it), its address."""
    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    receiver = KvReceiver(CONSUMER)
    port = receiver.start("127.0.0.1", 0)
    yield receiver, f"127.0.0.1:{port}"
    receiver.stop()


def silent(stop: threading.Event):
    """A PushKv request stream that says nothing until `stop` (bounded)."""
    stop.wait(30)
    return
    yield


def open_fds() -> int:
    """This process's descriptors of /dev/null (what the tests send): other descriptors come and
    go with the process's own threads (gRPC's, torch's), which a count of them all would read
    as parked."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
        except OSError:  # closed since the listing
            pass
    return count


def until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_with_every_stream_held_by_silent_peers_a_handshake_and_a_transfer_get_through(guarded):
    receiver, address = guarded
    stop = threading.Event()
    channel = grpc.insecure_channel(address)
    sender = kv_sender(CONSUMER, "127.0.0.1", CPU)
    try:
        opened = time.monotonic()
        calls = [
            wire_grpc.KvReceiverStub(channel).PushKv.future(silent(stop))
            for _ in range(MAX_STREAMS)
        ]
        time.sleep(0.3)  # each has reached its handler, or been displaced
        started = time.monotonic()
        handshake(address, CONSUMER)  # raises past CONTROL_TIMEOUT_S (2 s)
        assert time.monotonic() - started < 2.0
        sender.send(address, "grpc", piece("t-1"))  # a sender's stream displaces a silent one
        got, cancelled = take_until(receiver, slices=1)
        assert [p.transfer_id for p in got] == ["t-1"] and cancelled == {}
        got[0].release()
        assert until(lambda: all(call.done() for call in calls), 5.0 - (time.monotonic() - opened))
        codes = {call.exception().code() for call in calls}
        assert codes <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    finally:
        stop.set()
        sender.close()
        channel.close()


def test_a_silent_stream_ends_after_the_hello_wait_and_the_oldest_makes_room(guarded):
    _, address = guarded
    stop = threading.Event()
    channel = grpc.insecure_channel(address)
    try:
        first = wire_grpc.KvReceiverStub(channel).PushKv.future(silent(stop))
        time.sleep(0.3)
        later = [
            wire_grpc.KvReceiverStub(channel).PushKv.future(silent(stop))
            for _ in range(HELLO_STREAMS)
        ]
        assert until(first.done, 1.0), "the oldest silent stream was not displaced"
        assert first.exception().code() == grpc.StatusCode.CANCELLED
        started = time.monotonic()
        assert until(lambda: all(call.done() for call in later), HELLO_WAIT_S + 2.0)
        assert time.monotonic() - started < HELLO_WAIT_S + 2.0
    finally:
        stop.set()
        channel.close()


def test_accepted_streams_are_bounded_and_the_control_calls_still_answer(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    monkeypatch.setattr(kv_receiver_module, "MAX_STREAMS", 1)
    receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    stop = threading.Event()
    channel = grpc.insecure_channel(address)

    def hello_then_silent():
        yield hello(CONSUMER)
        stop.wait(30)

    try:
        held = wire_grpc.KvReceiverStub(channel).PushKv.future(hello_then_silent())
        time.sleep(0.3)
        second = wire_grpc.KvReceiverStub(channel).PushKv.future(hello_then_silent())
        assert until(second.done, 2.0)
        assert second.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not held.done()  # an accepted stream may idle: it proved who it is
        handshake(address, CONSUMER)
    finally:
        stop.set()
        channel.close()
        receiver.stop()


def test_refused_hellos_are_logged_once_per_interval_not_once_each(monkeypatch, caplog):
    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    monkeypatch.setenv(SECRET_ENV, "an intruder's")
    try:
        with caplog.at_level(logging.INFO, "pdserve.kv"):
            for _ in range(20):
                with pytest.raises(Exception, match="secret"):
                    handshake(address, CONSUMER)
        refusals = [r for r in caplog.records if "secret" in r.getMessage()]
        assert len(refusals) == 1
    finally:
        receiver.stop()


# shm ---------------------------------------------------------------------------------------


def connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(socket_name(address))
    sock.settimeout(HELLO_WAIT_S + 3.0)
    return sock


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the receiver closed the connection within `within_s` (EOF or reset)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_descriptors_sent_before_a_hello_are_closed_as_they_come(guarded):
    _, address = guarded
    sock = connect(address)
    try:
        baseline = open_fds()
        sock.sendall(struct.pack("<I", 1000))  # a frame that never completes
        for _ in range(50):
            fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(8)]
            try:
                socket.send_fds(sock, [b"\0"], fds)
            finally:
                for fd in fds:
                    os.close(fd)
        # 400 descriptors sent: none parked in this (the receiver's) process, closed as they
        # came, while the connection still waits for its hello (not by its end: a loaded host
        # takes a while, so the wait is the hello's)
        parked = until(lambda: open_fds() <= baseline, HELLO_WAIT_S)
        assert parked and not closed_by_peer(sock, 0.01), f"{open_fds() - baseline} parked"
        assert closed_by_peer(sock, HELLO_WAIT_S + 2.0)
    finally:
        sock.close()


def test_a_frame_above_the_cap_before_the_hello_closes_the_connection_at_once(guarded):
    _, address = guarded
    sock = connect(address)
    try:
        sock.sendall(struct.pack("<I", MAX_FRAME_BYTES + 1))
        assert closed_by_peer(sock, 1.0)
    finally:
        sock.close()


def test_a_hello_sent_with_a_descriptor_is_refused(guarded):
    _, address = guarded
    sock = connect(address)
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        send_frame(sock, hello(CONSUMER), (fd,))
        reply = wire.ShmReply.FromString(FrameReader(sock).read(HELLO_WAIT_S + 2.0))
        assert not reply.handshake.accepted
        assert "file descriptors sent before the hello" in reply.handshake.error
    finally:
        os.close(fd)
        sock.close()


def test_a_correct_hello_is_still_accepted(guarded):
    _, address = guarded
    sock = connect(address)
    try:
        send_frame(sock, hello(CONSUMER))
        reply = wire.ShmReply.FromString(FrameReader(sock).read(HELLO_WAIT_S + 2.0))
        assert reply.handshake.accepted, reply.handshake.error
    finally:
        sock.close()


def test_a_connection_from_another_user_is_closed_at_accept(guarded, monkeypatch):
    _, address = guarded
    another_users_peer(monkeypatch)
    sock = connect(address)
    try:
        assert closed_by_peer(sock, 1.0)
    finally:
        sock.close()


def test_connections_are_bounded(guarded, monkeypatch):
    _, address = guarded
    monkeypatch.setattr(shm_transport, "MAX_CONNECTIONS", 2)
    held = [connect(address) for _ in range(2)]
    extra = connect(address)
    try:
        assert closed_by_peer(extra, 1.0)
        assert not closed_by_peer(held[0], 0.2)
    finally:
        for sock in [*held, extra]:
            sock.close()


def test_a_log_limit_logs_each_kind_once_per_interval_and_says_how_many_it_left_out(caplog):
    from kv_transfer.log_limit import LogLimit

    now = [0.0]
    limit = LogLimit(logging.getLogger("pdserve.test"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "pdserve.test"):
        assert limit.error("refused", "refused %s", "a")
        assert not limit.error("refused", "refused %s", "b")
        assert not limit.error("refused", "refused %s", "c")
        assert limit.error("late", "late %s", "d")  # another kind
        now[0] = 10.0
        assert limit.error("refused", "refused %s", "e")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "late d",
        "refused e (and 2 more like it in the last 10 s, not logged)",
    ]
