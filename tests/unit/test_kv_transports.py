"""Every KV transport (grpc, nccl on gloo, shm) against the real receiver, in this process and
with a sender process killed mid-transfer: bytes arrive whole and labelled, a refused handshake
cancels the transfers it carried, a dead sender's transfers are cancelled on the receiver, a
full inbox stops the sender instead of growing, idle channels close, nothing is leaked (staged
buffers, inbox room, shared memory, descriptors)."""

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from kv_transfer.channels import kv_sender
from kv_transfer.host_staging import ByteBudget, DeviceToHost, StagingError
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import TRANSPORTS
from pdserve.settings.cluster_secret import SECRET_ENV
from tests.unit.kv_endpoints import CONSUMER, DEADLINE_S, piece, take_until

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def memfds_after_close() -> int:
    """Segments still open in this process once the receiver has seen the channel close."""
    deadline = time.monotonic() + DEADLINE_S
    while memfds() and time.monotonic() < deadline:
        time.sleep(0.02)
    return memfds()


def memfds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:pdserve-kv" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            pass
    return count


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_slices_arrive_whole_labelled_and_every_buffer_is_released(receiver, transport):
    kv_receiver, address = receiver
    shm_before = set(os.listdir("/dev/shm"))
    sender = kv_sender(CONSUMER, "127.0.0.1", CPU)
    sent = [piece("t-1", (9 << 20) + 123, layer=0), piece("t-1", 5, layer=1)]  # spans segments
    try:
        for one in sent:
            sender.send(address, transport, one)
        got, cancelled = take_until(kv_receiver, slices=2)
        assert cancelled == {}
        carrier = "gloo" if transport == "nccl" else transport  # what carried it, on CPUs
        assert [(p.transfer_id, p.layer, p.transport) for p in got] == [
            ("t-1", 0, carrier),
            ("t-1", 1, carrier),
        ]
        for arrived, one in zip(got, sent, strict=True):
            assert bytes(arrived.data) == one.data.ready().numpy().tobytes()
        assert kv_receiver.inbox.held == sum(len(p.data) for p in got)
        for arrived in got:
            arrived.release()
            arrived.release()  # a second release frees nothing twice
        assert kv_receiver.inbox.held == 0
        del got, arrived  # a slice lent from a segment maps it until dropped
    finally:
        sender.close()
    assert [one.data.releases for one in sent] == [1, 1]
    assert set(os.listdir("/dev/shm")) == shm_before
    assert memfds_after_close() == 0, "the closed shm channel left segments mapped"
    assert take_until(kv_receiver)[1] == {}, "a channel closed on purpose cancelled its transfers"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_handshake_cancels_its_transfers_and_a_later_send_opens_a_new_channel(
    receiver, transport
):
    kv_receiver, address = receiver
    sender = kv_sender(replace(CONSUMER, dtype="bfloat16"), "127.0.0.1", CPU)
    try:
        first = piece("t-1")
        sender.send(address, transport, first)
        sender.send(address, transport, piece("t-2"))  # while the first channel may be ending
        seen = take_until(kv_receiver, cancels={"t-1", "t-2"})[1]
        assert set(seen) == {"t-1", "t-2"}
        assert {cancel.failure for cancel in seen.values()} == {Failure.REFUSED}
        assert all(
            "dtype: producer 'bfloat16' != consumer 'float32'" in cancel.reason
            for cancel in seen.values()
        )
        sender.send(address, transport, piece("t-3"))  # after it ended: a new channel
        assert set(take_until(kv_receiver, cancels={"t-3"})[1]) == {"t-3"}
        assert first.data.releases == 1
        assert kv_receiver.take() == ([], {})
    finally:
        sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_without_the_cluster_secret_is_refused_and_writes_nothing(monkeypatch, transport):
    from kv_transfer.grpc_transport import cancel_transfer

    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    kv_receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{kv_receiver.start('127.0.0.1', 0)}"
    monkeypatch.setenv(SECRET_ENV, "an intruder's")  # what this process's senders now carry
    intruder = kv_sender(CONSUMER, "127.0.0.1", CPU)
    try:
        refused = piece("t-1")
        intruder.send(address, transport, refused)
        deadline = time.monotonic() + DEADLINE_S
        while refused.data.releases == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert refused.data.releases == 1  # its channel was refused: the sender let it go
        with pytest.raises(grpc.RpcError) as caught:  # nor may it cancel others' transfers
            cancel_transfer(address, "someone-else's", Cancel(Failure.CANCELLED, "intruder"))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Final, not a snapshot: the sender let go of the refused slice (it cannot come
        # anymore) and the cancel was refused before it answered.
        assert kv_receiver.take() == ([], {})  # nothing written, nothing cancelled
        monkeypatch.setenv(SECRET_ENV, "the cluster's")
        member = kv_sender(CONSUMER, "127.0.0.1", CPU)
        try:
            member.send(address, transport, piece("t-2"))
            got, cancelled = take_until(kv_receiver, slices=1)
            assert [p.transfer_id for p in got] == ["t-2"] and cancelled == {}
            for arrived in got:
                arrived.release()
            del got, arrived
        finally:
            member.close()
    finally:
        intruder.close()
        kv_receiver.stop()


SENDER_PROCESS = textwrap.dedent(
    """
    import os, sys, time, torch
    from kv_transfer.channels import channel_opener
    from kv_transfer.compatibility import Compatibility
    from kv_transfer.host_staging import Staged
    from kv_transfer.kv_layout import WIRE_LAYOUT
    from kv_transfer.transport import LayerSlice

    compatibility = Compatibility("m", "float32", 16, 2, 2, 4, WIRE_LAYOUT, "0.32.0", 32, "none")
    channel = channel_opener(compatibility, "127.0.0.1", torch.device("cpu"))(
        sys.argv[2], sys.argv[1]
    )
    data = torch.ones(1 << 20, dtype=torch.uint8)
    channel.send(LayerSlice("dying", 0, 0, 1, 0, 2, Staged(data, data.numel()), False))
    print("sent", flush=True)
    time.sleep(60)  # killed here, mid-transfer (layer 1 never comes)
    """
)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sender_killed_mid_transfer_gets_its_transfer_cancelled_on_the_receiver(
    receiver, transport
):
    kv_receiver, address = receiver
    process = subprocess.Popen(
        [sys.executable, "-c", SENDER_PROCESS, address, transport],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "sent"
        got, _ = take_until(kv_receiver, slices=1)
        assert [p.transfer_id for p in got] == ["dying"]
        got[0].release()
        started = time.monotonic()
        process.kill()
        cancelled = take_until(kv_receiver, cancels={"dying"})[1]
        assert "dying" in cancelled, "the dead sender's transfer was left to its deadline"
        assert cancelled["dying"].failure == Failure.CANCELLED
        assert "mid" in cancelled["dying"].reason or "failed" in cancelled["dying"].reason
        print(f"{transport}: cancelled {time.monotonic() - started:.2f} s after the kill")
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()
    assert kv_receiver.inbox.held == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_full_inbox_stops_the_sender_and_fails_its_transfer_instead_of_growing(transport):
    """Nobody takes what arrives (a decode worker not stepping): the inbox stays within its
    bound, the stream stalls, and the transfer is cancelled once the wait runs out."""
    kv_receiver = KvReceiver(CONSUMER, inbox_bytes=2 << 20, inbox_wait_s=0.5)
    address = f"127.0.0.1:{kv_receiver.start('127.0.0.1', 0)}"
    sender = kv_sender(CONSUMER, "127.0.0.1", CPU)
    sent = [piece("stalled", 1 << 20, layer=layer % 2, last=False) for layer in range(6)]
    try:
        for one in sent:
            sender.send(address, transport, one)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and "stalled" not in kv_receiver.inbox.cancelled:
            assert kv_receiver.inbox.held <= 2 << 20
            time.sleep(0.02)
        assert "stalled" in kv_receiver.inbox.cancelled
        assert kv_receiver.inbox.held <= 2 << 20
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and any(one.data.releases != 1 for one in sent):
            time.sleep(0.02)
        assert [one.data.releases for one in sent] == [1] * 6  # queued ones too
    finally:
        sender.close()
        kv_receiver.stop()


def test_an_idle_channel_closes_on_purpose_and_the_next_slice_reopens_it(receiver):
    from kv_transfer.channels import channel_opener
    from kv_transfer.grpc_transport import cancel_transfer
    from kv_transfer.transport import KvSender

    kv_receiver, address = receiver
    sender = KvSender(channel_opener(CONSUMER, "127.0.0.1", CPU), cancel_transfer, 0.2)
    try:
        sender.send(address, "shm", piece("t-1"))
        (arrived,) = take_until(kv_receiver, slices=1)[0]
        arrived.release()
        del arrived  # a slice lent from a segment maps it until dropped
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and sender.queues:
            time.sleep(0.02)
        assert sender.queues == {}
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and sender.threads:
            time.sleep(0.02)
        assert sender.threads == {}  # the channel's thread is gone, not kept
        assert memfds_after_close() == 0
        sender.send(address, "shm", piece("t-2"))
        assert [p.transfer_id for p in take_until(kv_receiver, slices=1)[0]] == ["t-2"]
        assert kv_receiver.take()[1] == {}  # idle closes cancel nothing
    finally:
        sender.close()


def test_a_stopped_receiver_frees_its_address_at_once_even_with_a_sender_connected():
    """The next receiver on the same port (a restart, or the OS reusing the port) must bind."""
    from kv_transfer.channels import channel_opener
    from kv_transfer.grpc_transport import cancel_transfer
    from kv_transfer.transport import KvSender

    first = KvReceiver(CONSUMER)
    port = first.start("127.0.0.1", 0)
    sender = KvSender(channel_opener(CONSUMER, "127.0.0.1", CPU), cancel_transfer)
    try:
        sender.send(f"127.0.0.1:{port}", "shm", piece("t-1"))
        (arrived,) = take_until(first, slices=1)[0]  # a connection thread is now blocked reading
        arrived.release()
        del arrived
        first.stop()
        second = KvReceiver(CONSUMER)
        assert second.start("127.0.0.1", port) == port
        second.stop()
    finally:
        sender.close()
        first.stop()


def test_the_send_budget_makes_the_forward_pass_wait_then_gives_up():
    budget = ByteBudget(100)
    budget.acquire(60)
    started = time.monotonic()
    with pytest.raises(StagingError, match="stayed full"):
        budget.acquire(60, timeout_s=0.2)
    assert time.monotonic() - started >= 0.2
    with pytest.raises(StagingError, match="larger than"):
        budget.acquire(101)
    budget.release(60)
    budget.acquire(100)  # room again


def test_cpu_staging_counts_against_the_budget_until_released():
    staging = DeviceToHost(CPU, 1 << 20)
    first = staging.stage(lambda: torch.zeros(1 << 19, dtype=torch.uint8))
    second = staging.stage(lambda: torch.zeros(1 << 19, dtype=torch.uint8))
    with pytest.raises(StagingError):
        staging.budget.acquire(1, timeout_s=0.05)
    first.release()
    first.release()  # once only
    second.release()
    assert staging.budget.in_use == 0


def test_forced_shm_to_another_host_fails_with_a_reason_not_silently():
    from kv_transfer.shm_transport import ShmChannel
    from kv_transfer.transport import ChannelError

    with pytest.raises(ChannelError, match="no shared-memory KV receiver for 10.1.2.3:5555"):
        ShmChannel("10.1.2.3:5555", CONSUMER)


def test_the_compatibility_fingerprint_differs_exactly_when_a_field_does():
    assert CONSUMER.fingerprint() == replace(CONSUMER).fingerprint()
    changed = [
        replace(CONSUMER, dtype="bfloat16"),
        replace(CONSUMER, block_size=CONSUMER.block_size * 2),
        replace(CONSUMER, vllm_version="0.33.0"),
    ]
    assert len({CONSUMER.fingerprint(), *(c.fingerprint() for c in changed)}) == 4
