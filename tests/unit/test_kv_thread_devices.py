"""Every pdserve thread that may touch CUDA binds its rank's device first (review §3.6): the KV
sender's thread, the receiver's PushKv handler threads and its shm connection threads. A fresh
thread's CUDA calls (an event synchronize, a pinned buffer) go to GPU 0 and would make a context
there for a TP rank > 0 (~0.5 GiB each, outside the memory check). On CPU, with
torch.cuda.set_device recorded by a mock: each thread's first CUDA call is the binding."""

import threading

import pytest
import torch

from kv_transfer.channels import kv_sender
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.transport import KvSender, bind_device
from tests.unit.kv_endpoints import CONSUMER, piece, take_until
from tests.waiting import wait_for

RANK_1 = torch.device("cuda", 1)


@pytest.fixture
def bound(monkeypatch):
    """(thread name, device) of every torch.cuda.set_device call, in order."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(
        torch.cuda,
        "set_device",
        lambda device: calls.append((threading.current_thread().name, device)),
    )
    return calls


def test_the_sender_thread_binds_its_device_before_it_opens_a_channel(bound):
    events: list[str] = []

    class Channel:
        def __init__(self) -> None:
            events.append(f"open in {threading.current_thread().name}")

        def send(self, one) -> None:
            pass

        def close(self) -> None:
            pass

    sender = KvSender(lambda kind, destination: Channel(), lambda *a: None, device=RANK_1)
    try:
        sender.send("10.0.0.1:5000", "grpc", piece("t-1"))
        wait_for(lambda: events, 10, "the channel opened")
        assert events == ["open in kv-send-grpc-10.0.0.1:5000"]
        assert bound[0] == ("kv-send-grpc-10.0.0.1:5000", RANK_1)  # before the channel
    finally:
        sender.close()


def test_kv_sender_gives_its_threads_the_caches_device():
    assert kv_sender(CONSUMER, "127.0.0.1", RANK_1).device == RANK_1


def test_bind_device_leaves_cpu_and_unindexed_devices_alone(bound):
    bind_device(None)
    bind_device(torch.device("cpu"))
    bind_device(torch.device("cuda"))  # no index: the thread's current device stands
    assert bound == []
    bind_device(RANK_1)
    assert bound == [(threading.current_thread().name, RANK_1)]


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_the_receivers_stream_and_shm_threads_bind_the_ranks_device(bound, transport):
    receiver = KvReceiver(CONSUMER)
    port = receiver.start("127.0.0.1", 0)
    receiver.device = RANK_1  # the decode connector sets it once the caches are known
    sender = kv_sender(CONSUMER, "127.0.0.1", torch.device("cpu"))
    try:
        sender.send(f"127.0.0.1:{port}", transport, piece("t-1"))
        (arrived,) = take_until(receiver, slices=1)[0]
        arrived.release()
        prefix = "kv-receive" if transport == "grpc" else "kv-shm-receive"
        assert (prefix, RANK_1) in [(name.split("_")[0], device) for name, device in bound], bound
    finally:
        sender.close()
        receiver.stop()
