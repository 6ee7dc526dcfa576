"""A KV channel remembers only the transfers in flight on it (security review 2026-12, M9): a
transfer leaves the set once its last slice of every layer went through, on the sender and on
the receiver, so a channel that fails after carrying 1000 finished transfers cancels only the
unfinished ones, one after another from one thread."""

import threading
import time

from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import (
    CANCEL_GIVE_UP,
    MAX_CARRIED,
    Carried,
    ChannelError,
    Inbox,
    KvSender,
    SliceAssembler,
)
from tests.unit.kv_endpoints import CONSUMER, piece  # CONSUMER has 2 layers

FINISHED = 1000


class FailingChannel:
    """Takes every slice until one of transfer "boom" comes."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, out) -> None:
        if out.transfer_id == "boom":
            raise ChannelError("the receiver went away")
        self.sent += 1

    def close(self) -> None:
        pass


def test_a_failed_channel_cancels_only_the_transfers_it_had_not_sent_whole():
    cancels: list[tuple[str, str]] = []
    threads: set[str] = set()
    done = threading.Event()

    def cancel(destination: str, transfer_id: str, cancel: Cancel) -> None:
        cancels.append((destination, transfer_id))
        threads.add(threading.current_thread().name)
        if len(cancels) == 2:
            done.set()

    channel = FailingChannel()
    sender = KvSender(lambda kind, destination: channel, cancel, num_layers=2)
    try:
        for n in range(FINISHED):
            for layer in (0, 1):
                sender.send("decode:1", "grpc", piece(f"done-{n}", 16, layer=layer, last=True))
        sender.send("decode:1", "grpc", piece("half", 16, layer=0, last=True))  # layer 1 to come
        sender.send("decode:1", "grpc", piece("boom", 16))
        assert done.wait(15), f"cancels: {cancels}"
        time.sleep(0.2)  # no more come
    finally:
        sender.close()
    assert channel.sent == 2 * FINISHED + 1
    assert sorted(cancels) == [("decode:1", "boom"), ("decode:1", "half")]
    assert len(threads) == 1  # one thread for the failure, not one per transfer


def test_the_receiver_forgets_a_transfer_once_every_layer_ended_and_abandons_only_the_rest():
    inbox = Inbox(max_bytes=1 << 30, verify=False)
    assembler = SliceAssembler(inbox, "grpc", CONSUMER)

    class Chunk:
        def __init__(self, transfer_id, layer, last) -> None:
            self.transfer_id, self.layer, self.last = transfer_id, layer, last
            self.first_block, self.num_blocks, self.first_head, self.num_heads = 0, 1, 0, 2
            self.offset, self.slice_bytes, self.epoch, self.seq, self.digest = 0, 8, 0, 0, 0

    for n in range(FINISHED):
        for layer in (0, 1):
            assembler.add(Chunk(f"done-{n}", layer, True), bytes(8))
    assembler.add(Chunk("half", 0, True), bytes(8))
    assembler.add(Chunk("early", 1, False), bytes(8))
    assert len(assembler.carried) == 2
    for arrived in inbox.take()[0]:
        arrived.release()
    assembler.abandon("the stream failed")
    failed = Cancel(Failure.CANCELLED, "the stream failed")
    assert inbox.take()[1] == {"half": failed, "early": failed}


def test_a_stream_remembers_at_most_max_carried_unfinished_transfers():
    carried = Carried(num_layers=2)
    for n in range(MAX_CARRIED + 10):
        carried.begin(f"given-up-{n}")  # their senders gave them up: no last slice comes
    assert len(carried) == MAX_CARRIED
    assert "given-up-0" not in carried and f"given-up-{MAX_CARRIED + 9}" in carried


def test_cancels_stop_once_the_receiver_takes_none():
    failing_cancels = CANCEL_GIVE_UP
    calls: list[str] = []
    finished = threading.Event()

    def cancel(destination: str, transfer_id: str, cancel: Cancel) -> None:
        calls.append(transfer_id)
        if len(calls) >= failing_cancels:
            finished.set()
        raise ChannelError("unreachable")

    sender = KvSender(lambda kind, destination: None, cancel)
    failed = Cancel(Failure.CANCELLED, "the channel failed")
    sender.cancel_all("decode:1", [f"t-{n}" for n in range(100)], failed)
    assert finished.wait(5)
    time.sleep(0.2)
    assert len(calls) == failing_cancels
