"""The nccl transport fails soft, proved with real gloo groups on 127.0.0.1 (the same code path
NCCL runs; what only CUDA shows is in scripts/gpu_check.py): a peer that never joins fails the
group's creation within its deadline, a peer that stops answering fails the operation at its
deadline, a peer killed mid-send or between a slice's descriptor and its bytes fails the
survivor's side at once, and the survivor serves the next transfer over a new group; every
group is aborted on teardown, and teardown is bounded; an idle channel keeps its group until
its receiver ends the control stream."""

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from kv_transfer import nccl_transport
from kv_transfer.channels import channel_opener
from kv_transfer.nccl_transport import NcclChannel, PairGroup, rendezvous
from kv_transfer.transport import ChannelError, KvSender
from tests.unit.kv_endpoints import CONSUMER, piece, take_until
from tests.waiting import wait_for

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1.0  # the groups' deadline in these tests
NOTICED_S = 5.0  # a dead peer must be noticed this fast: far less than any deadline
SLICE_BYTES = 16 << 20  # more than loopback's socket buffers: a send blocks on its receiver


def store(port: int = 0, master: bool = True) -> TCPStore:
    return TCPStore(
        "127.0.0.1",
        port,
        world_size=2,
        is_master=master,
        timeout=timedelta(seconds=TIMEOUT_S),
        wait_for_workers=False,
    )


def pair(rank: int, on) -> PairGroup:
    return PairGroup(on, "gloo", rank, "127.0.0.1", CPU, TIMEOUT_S)


def test_a_peer_that_never_joins_fails_the_rendezvous_within_its_deadline():
    started = time.monotonic()
    with pytest.raises(ChannelError, match="did not join"):
        pair(0, store())
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 1


def test_a_peer_that_joins_the_store_but_never_makes_its_group_fails_creation_in_time():
    master = store()
    peer = store(master.port, master=False)
    # The peer checks in on the store, then never makes its communicator.
    threading.Thread(target=rendezvous, args=(peer, 1, TIMEOUT_S), daemon=True).start()
    started = time.monotonic()
    with pytest.raises(ChannelError, match="gloo group"):
        pair(0, master)
    assert time.monotonic() - started < TIMEOUT_S + 1


def test_a_peer_that_stops_answering_fails_the_send_at_its_deadline_and_the_group_stays_failed():
    master = store()
    made: dict[str, PairGroup] = {}
    joining = threading.Thread(
        target=lambda: made.update(peer=pair(1, store(master.port, master=False)))
    )
    joining.start()
    sender = pair(0, master)
    joining.join(TIMEOUT_S * 4)
    peer = made["peer"]  # joined, then never receives
    started = time.monotonic()
    with pytest.raises(ChannelError, match="KV send failed"):
        sender.send(torch.ones(SLICE_BYTES, dtype=torch.uint8))
    took = time.monotonic() - started
    assert TIMEOUT_S <= took < TIMEOUT_S + 1
    assert sender.aborted == "KV send failed"
    with pytest.raises(ChannelError, match="aborted"):  # at once, no second deadline
        sender.send(torch.ones(1, dtype=torch.uint8))
    started = time.monotonic()
    sender.close()
    peer.close()
    assert time.monotonic() - started < 1.0, "teardown of a failed group is not bounded"
    print(f"send failed {took:.2f} s after it began (deadline {TIMEOUT_S:g} s)")


def test_an_nccl_group_is_made_with_its_own_error_handling_and_the_process_env_restored(
    monkeypatch,
):
    """ProcessGroupNCCL reads these when constructed: only pdserve's groups get them. What was
    there comes back, or torch's default: a variable is never removed (a GPU worker has them
    all from its start, so a group's are values replaced in place, never the environment
    growing or shrinking under vLLM's threads)."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    with nccl_transport._nccl_group_env(7.5):
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly
        assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "1"  # torch's default, not removed
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "8"  # read once per process: kept
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "99")
    with nccl_transport._nccl_group_env(7.5):
        assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "99"  # the user's stands


RECEIVER_PROCESS = textwrap.dedent(
    """
    import time
    from kv_transfer.kv_receiver import KvReceiver
    from tests.unit.kv_endpoints import CONSUMER

    receiver = KvReceiver(CONSUMER, inbox_bytes=1 << 20, inbox_wait_s=120)  # nobody takes
    print(receiver.start("127.0.0.1", 0), flush=True)
    time.sleep(120)  # killed here, with a sender blocked on it
    """
)


def test_a_receiver_killed_mid_send_fails_the_channel_at_once_and_the_sender_serves_the_next(
    receiver,
):
    kv_receiver, address = receiver
    cancels: list[tuple[str, str]] = []
    sender = KvSender(
        channel_opener(CONSUMER, "127.0.0.1", CPU),
        lambda destination, transfer_id, reason: cancels.append((destination, transfer_id)),
    )
    process = subprocess.Popen(
        [sys.executable, "-c", RECEIVER_PROCESS], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        doomed = f"127.0.0.1:{process.stdout.readline().strip()}"
        sent = [piece("doomed", SLICE_BYTES, layer=layer) for layer in range(4)]
        for one in sent:
            sender.send(doomed, "nccl", one)
        # The receiver holds one slice and waits for room for the next before it receives
        # it (a receive buffer is made only with room in the inbox): the second is mid-send.
        wait_for(lambda: sent[0].data.releases, 20, "the first slice sent")
        time.sleep(0.3)
        assert sent[1].data.releases == 0, "the second slice should be blocked mid-send"
        started = time.monotonic()
        process.kill()
        wait_for(lambda: (doomed, "nccl") not in sender.threads, NOTICED_S, "the channel failed")
        noticed = time.monotonic() - started
        wait_for(lambda: cancels, NOTICED_S, "the carried transfer cancelled")
        assert cancels == [(doomed, "doomed")]
        assert [one.data.releases for one in sent] == [1] * 4  # the queued one too
        sender.send(address, "nccl", piece("next", 1 << 20))  # the survivor serves on
        got, cancelled = take_until(kv_receiver, slices=1)
        assert [(p.transfer_id, p.transport) for p in got] == [("next", "gloo")]
        assert cancelled == {}
        got[0].release()
        print(f"the sender noticed the kill after {noticed:.2f} s")
    finally:
        sender.close()
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


SENDER_PROCESS = textwrap.dedent(
    """
    import sys, time
    from kv_transfer import kv_wire_pb2 as wire
    from kv_transfer.grpc_transport import slice_chunk
    from kv_transfer.nccl_transport import NcclChannel
    from tests.unit.kv_endpoints import CONSUMER, piece

    channel = NcclChannel(sys.argv[1], CONSUMER, "127.0.0.1", __import__("torch").device("cpu"))
    half = piece("dying", 1 << 20)
    channel.stream.put(wire.KvMessage(chunk=slice_chunk(half, 0, half.data.nbytes)))
    print("described", flush=True)
    time.sleep(120)  # killed here: the descriptor went, its bytes never will
    """
)


def test_a_sender_killed_between_descriptor_and_bytes_fails_the_receive_and_the_receiver_serves_on(
    receiver,
):
    kv_receiver, address = receiver
    process = subprocess.Popen(
        [sys.executable, "-c", SENDER_PROCESS, address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "described"
        time.sleep(0.3)  # the receiver is now waiting in its receive
        started = time.monotonic()
        process.kill()
        cancelled = take_until(kv_receiver, cancels={"dying"})[1]
        noticed = time.monotonic() - started
        assert "dying" in cancelled, "the dead sender's transfer was left to its deadline"
        assert noticed < NOTICED_S
        channel = NcclChannel(address, CONSUMER, "127.0.0.1", CPU, timeout_s=TIMEOUT_S)
        try:
            channel.send(piece("next", 1 << 20))
            got, _ = take_until(kv_receiver, slices=1)
            assert [p.transfer_id for p in got] == ["next"]
            got[0].release()
        finally:
            channel.close()
        print(f"the receiver cancelled the transfer {noticed:.2f} s after the kill")
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()
    assert kv_receiver.inbox.held == 0


def test_an_idle_channel_keeps_its_group_until_its_receiver_ends_the_stream(receiver):
    """Making a group costs a rendezvous and a communicator (seconds on GPUs): an idle nccl
    channel is not closed after idle_close_s, so the next request does not pay them. Once its
    receiver ends the control stream (a restart here), the idle channel is closed quietly (its
    group aborted, nothing cancelled) and the next slice makes a new group."""
    from kv_transfer.kv_receiver import KvReceiver
    from kv_transfer.transport import LIVENESS_S

    kv_receiver, address = receiver
    opened: list[NcclChannel] = []
    open_channel = channel_opener(CONSUMER, "127.0.0.1", CPU)

    def opening(kind, destination):
        opened.append(open_channel(kind, destination))
        return opened[-1]

    sender = KvSender(opening, lambda *cancel: cancels.append(cancel), idle_close_s=0.1)
    cancels: list = []
    restarted = None
    try:
        for transfer_id in ("t-1", "t-2"):
            sender.send(address, "nccl", piece(transfer_id))
            (arrived,) = take_until(kv_receiver, slices=1)[0]
            assert arrived.transfer_id == transfer_id
            arrived.release()
            time.sleep(0.3)  # three times idle_close_s
            assert sender.threads and not opened[0].group.aborted, "closed while idle"
        assert len(opened) == 1, "the second transfer paid for a new group"
        kv_receiver.stop()  # ends the stream: the sender sees its channel gone
        wait_for(lambda: not sender.threads, LIVENESS_S + 10, "the dead idle channel closed")
        assert opened[0].group.aborted and opened[0].group.group is None
        restarted = KvReceiver(CONSUMER)
        assert restarted.start("127.0.0.1", int(address.rsplit(":", 1)[1])) > 0
        sender.send(address, "nccl", piece("t-3"))
        (arrived,) = take_until(restarted, slices=1)[0]
        assert arrived.transfer_id == "t-3"
        arrived.release()
        assert len(opened) == 2 and opened[0].group is not opened[1].group
        assert cancels == [] and restarted.take()[1] == {}  # nothing was cancelled
    finally:
        sender.close()
        if restarted is not None:
            restarted.stop()
