"""End-to-end KV integrity (kv_transfer/integrity.py) against injected faults (tests/kv_faults.py):
the digest catches what it claims to, and every injected fault kind, on every transport (grpc,
nccl on gloo, shm), through the real classes from a prefill cache to a decode cache (layer
sender -> KV sender -> transport -> receiver -> loader), per-head K/V caches and an MLA latent
alike, fails its transfer with the right kind and writes nothing wrong, while a clean transfer
beside it loads exactly. CPU tensors, no engine."""

import random
import time
from dataclasses import replace

import pytest
import torch

from decode_workers.kv_loader import KvLoader
from kv_transfer.channels import CHANNEL_WRAPPER_ENV, channel_opener, wrapped
from kv_transfer.grpc_transport import cancel_transfer
from kv_transfer.host_staging import Staged
from kv_transfer.integrity import Damage, as_tensor, slice_digest, transfer_epoch
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.metadata import Expected, SendSlice
from kv_transfer.transfer_report import Failure
from kv_transfer.transport import TRANSPORTS, KvSender, LayerSlice
from prefill_workers.kv_sender import LayerSender
from tests.kv_faults import (
    FAULT_FILE_ENV,
    FaultyChannel,
    KvFault,
    KvFaultKind,
    faulty,
    injectable_environment,
    parse_kv_fault,
    set_fault,
)
from tests.unit.kv_endpoints import CONSUMER

CPU = torch.device("cpu")
LAYOUT = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))


def block_shape(engine, layout: LayerLayout) -> tuple[int, int, int]:
    """One block of a layer's [blocks, heads, block_size, content] cache."""
    return (engine.total_kv_heads, engine.block_size, layout.kv_size * engine.head_size)


BLOCK_SHAPE = block_shape(CONSUMER, LAYOUT)
# An MLA latent: one head of 8 values a token (the same 32 bytes as a K/V head-token here), no V.
MLA = replace(CONSUMER, total_kv_heads=1, head_size=8)
CACHES = {  # name -> (the engine's side of the handshake, its layer layout)
    "per-head K/V": (CONSUMER, LAYOUT),
    "MLA latent": (MLA, LayerLayout((BLOCK, HEAD, TOKEN, CONTENT), kv_size=1)),
}
NUM_BLOCKS = 8
DEADLINE_S = 15.0
CAUGHT_AS = {
    KvFaultKind.CORRUPT: Damage.DIGEST,
    KvFaultKind.TRUNCATE: Damage.LENGTH,
    KvFaultKind.DUPLICATE: Damage.DUPLICATE,
    KvFaultKind.REORDER: Damage.ORDER,
    KvFaultKind.STALE: Damage.STALE,
    KvFaultKind.DELAY: None,  # late, not wrong: loaded
}


# The digest ---------------------------------------------------------------------------------


def test_every_single_flipped_bit_changes_the_digest():
    data = torch.randint(0, 256, (40 * 1024 + 13,), dtype=torch.uint8)  # rows and a tail
    clean = slice_digest(data)
    rng = random.Random(0)
    for at in [0, 1, 4095, 4096, data.numel() - 1, *rng.sample(range(data.numel()), 40)]:
        for bit in range(8):
            flipped = data.clone()
            flipped[at] ^= 1 << bit
            assert slice_digest(flipped) != clean, (at, bit)


def test_reordered_words_or_rows_and_truncation_change_the_digest():
    data = torch.randint(-(1 << 62), 1 << 62, (3 * 512 + 7,), dtype=torch.int64)
    clean = slice_digest(data)
    swapped = data.clone()
    swapped[[3, 900]] = data[[900, 3]]
    rows = data.clone()
    rows[:512], rows[512:1024] = data[512:1024], data[:512]
    assert slice_digest(swapped) != clean
    assert slice_digest(rows) != clean
    raw = data.view(torch.uint8)
    assert slice_digest(raw[:-1]) != clean
    zeros = torch.zeros(8, dtype=torch.uint8)
    assert slice_digest(torch.cat([raw, zeros])) != slice_digest(raw)  # even trailing zeros


def test_the_digest_reads_bytes_whatever_holds_them():
    values = torch.randn(3, 5, 7)
    raw = values.view(torch.uint8).reshape(-1)
    expected = slice_digest(values)
    assert slice_digest(raw) == expected
    assert slice_digest(as_tensor(bytearray(raw.numpy().tobytes()))) == expected
    assert slice_digest(as_tensor(memoryview(raw.numpy().tobytes()))) == expected  # read-only
    assert slice_digest(raw[1:].clone()) != expected
    unaligned = torch.empty(raw.numel() + 1, dtype=torch.uint8)[1:]
    unaligned.copy_(raw)
    assert slice_digest(unaligned) == expected


def test_each_attempt_of_a_transfer_has_its_own_epoch():
    epochs = {transfer_epoch(t) for t in ("req-1", "req-1-retry1", "req-1-retry2", "req-2")}
    assert len(epochs) == 4 and 0 not in epochs
    assert transfer_epoch("req-1") == transfer_epoch("req-1")


def test_a_fault_setting_is_kind_colon_rate():
    assert parse_kv_fault("") is None
    fault = parse_kv_fault("corrupt:0.5")
    assert (fault.kind, fault.rate) == (KvFaultKind.CORRUPT, 0.5)
    for wrong in ("corrupt", "flip:1", "delay:x", "stale:1.5"):
        with pytest.raises(ValueError):
            parse_kv_fault(wrong)


# The real classes, prefill cache to decode cache --------------------------------------------


def prefill_caches(shape=BLOCK_SHAPE) -> list[torch.Tensor]:
    """A prefill rank's caches: every value names its layer, block and position."""
    size = NUM_BLOCKS * torch.Size(shape).numel()
    return [
        (torch.arange(size, dtype=torch.float32) + 1_000_000 * (layer + 1)).view(NUM_BLOCKS, *shape)
        for layer in range(CONSUMER.num_layers)
    ]


def send_prompt(sender: LayerSender, caches, transfer_id: str, destination: str, transport):
    """What a prefill worker's connector does for a 4-block prompt computed in two steps of two
    blocks: each step, each layer, the blocks it computed."""
    for first, last in ((0, False), (2, True)):
        step = [SendSlice(transfer_id, destination, first, [first + 1, first + 2], last, 1,
                          transport)]  # fmt: skip
        sender.new_step(step)
        for layer, cache in enumerate(caches):
            sender.save_layer(layer, cache, step)


def results(loader: KvLoader, expected: list[Expected], count: int) -> tuple[set, set]:
    """Every report of the loader until `count` requests are reported (loaded, failed)."""
    loaded, failed = set(), set()
    deadline = time.monotonic() + DEADLINE_S
    while len(loaded) < count:
        assert time.monotonic() < deadline, f"reported so far: {loaded}, failed {failed}"
        done, bad = loader.transfer_results(expected, set())
        expected = []
        loaded |= done
        failed |= bad
        time.sleep(0.01)
    return loaded - failed, failed


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", list(KvFaultKind))
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_fault_fails_its_transfer_as_what_it_is_and_writes_nothing_wrong(
    transport, kind, cache
):
    engine, layout = CACHES[cache]
    shape = block_shape(engine, layout)
    receiver = KvReceiver(engine)
    port = receiver.start("127.0.0.1", 0)
    decode = [torch.zeros(NUM_BLOCKS, *shape) for _ in range(engine.num_layers)]
    loader = KvLoader(receiver, decode, layout, engine.head_size, engine.total_kv_heads)
    # A clean transfer first (rate 0: the one a stale slice is kept from), then the faulty one.
    faults = {"clean": KvFault(kind, 0), "faulty": KvFault(kind, 1)}
    sender = LayerSender(
        KvSender(
            faulty(channel_opener(engine, "127.0.0.1", CPU), faults.get),
            cancel_transfer,
            num_layers=engine.num_layers,
            device=CPU,
        ),
        layout,
        engine.head_size,
        engine.total_kv_heads,
        1,
        0,
        CPU,
        64 << 20,
    )
    prefill = prefill_caches(shape)
    try:
        send_prompt(sender, prefill, "clean", f"127.0.0.1:{port}", transport)
        send_prompt(sender, prefill, "faulty", f"127.0.0.1:{port}", transport)
        expected = [
            Expected("clean-req", "clean", [1, 2, 3, 4], 0, DEADLINE_S),
            Expected("faulty-req", "faulty", [5, 6, 7, 0], 0, DEADLINE_S),
        ]
        loaded, failed = results(loader, expected, 2)
    finally:
        sender.close()
        receiver.stop()
    reports = {report.transfer_id: report for report in loader.take_reports()}
    assert "clean-req" in loaded
    assert reports["clean"].damage is None
    for layer in range(engine.num_layers):
        assert torch.equal(decode[layer][1:5], prefill[layer][1:5])
    caught = CAUGHT_AS[kind]
    assert reports["faulty"].damage == caught
    if not caught:
        assert "faulty-req" in loaded
        for layer in range(engine.num_layers):
            assert torch.equal(decode[layer][[5, 6, 7, 0]], prefill[layer][1:5])
        return
    assert "faulty-req" in failed and reports["faulty"].failure == Failure.INTEGRITY
    for layer in range(engine.num_layers):  # nothing of it differs from what was sent
        for decode_block, prefill_block in zip([5, 6, 7, 0], range(1, 5), strict=True):
            written = decode[layer][decode_block]
            assert not written.any() or torch.equal(written, prefill[layer][prefill_block])


# The loader's checks, slice by slice --------------------------------------------------------


class FakeReceiver:
    """Stands in for KvReceiver: hands the loader the slices the test gives it."""

    def __init__(self) -> None:
        self.slices: list[LayerSlice] = []

    def take(self):
        slices, self.slices = self.slices, []
        return slices, {}


def one_block(transfer_id="t", layer=0, seq=0, **fields) -> LayerSlice:
    data = bytearray(torch.ones(BLOCK_SHAPE).numpy().tobytes())
    fields.setdefault("epoch", transfer_epoch(transfer_id))
    return LayerSlice(transfer_id, layer, 0, 1, 0, 2, data, True, 0.0, "grpc", seq=seq, **fields)


@pytest.mark.parametrize(
    ("slices", "damage"),
    [
        ([one_block(epoch=transfer_epoch("t-retry1"))], Damage.STALE),
        ([one_block(), one_block(layer=1, seq=0)], Damage.DUPLICATE),
        ([one_block(seq=1), one_block(layer=1, seq=0)], Damage.ORDER),
        ([one_block(damage=Damage.DIGEST)], Damage.DIGEST),
    ],
    ids=["stale", "duplicate", "order", "digest"],
)
def test_a_damaged_slice_fails_its_transfer_and_is_not_loaded(slices, damage, caplog):
    receiver = FakeReceiver()
    cache = [torch.zeros(2, *BLOCK_SHAPE) for _ in range(CONSUMER.num_layers)]
    loader = KvLoader(receiver, cache, LAYOUT, CONSUMER.head_size, CONSUMER.total_kv_heads)
    receiver.slices = slices
    assert loader.transfer_results([Expected("req-t", "t", [1], 0, 5.0)], set()) == (
        {"req-t"},
        {"req-t"},
    )
    [report] = loader.take_reports()
    assert (report.failure, report.damage) == (Failure.INTEGRITY, damage)
    assert "KV transfer t (request req-t) failed its integrity check" in caplog.text
    assert not cache[1][1].any()  # the second slice came after the failure: not loaded either


def test_with_integrity_off_only_the_size_is_checked():
    receiver = FakeReceiver()
    cache = [torch.zeros(2, *BLOCK_SHAPE) for _ in range(CONSUMER.num_layers)]
    loader = KvLoader(
        receiver, cache, LAYOUT, CONSUMER.head_size, CONSUMER.total_kv_heads, integrity=False
    )
    receiver.slices = [one_block(epoch=0), one_block(layer=1, epoch=0)]
    assert loader.transfer_results([Expected("req-t", "t", [1], 0, 5.0)], set()) == (
        {"req-t"},
        set(),
    )
    short = one_block("u", epoch=0)
    receiver.slices = [replace(short, data=short.data[:-4])]
    assert loader.transfer_results([Expected("req-u", "u", [0], 0, 5.0)], set())[1] == {"req-u"}
    assert loader.take_reports()[-1].damage == Damage.LENGTH


# The settings' way to the connectors ----------------------------------------------------------


def test_integrity_is_on_by_default_and_reaches_both_connectors():
    from pdserve.settings.cluster_file import parse_cluster
    from pdserve.settings.worker import WorkerSettings
    from pdserve.worker.engine import kv_transfer_config

    for role in ("prefill", "decode"):
        default = kv_transfer_config(WorkerSettings(role=role), 0)
        off = kv_transfer_config(WorkerSettings(role=role, kv_integrity="off"), 0)
        assert default["kv_connector_extra_config"]["integrity"] is True
        assert off["kv_connector_extra_config"]["integrity"] is False
    cluster = parse_cluster({"transport": {"kv_integrity": "off"}})
    assert cluster.worker_settings("decode", "").kv_integrity == "off"
    assert parse_cluster({}).worker_settings("prefill", "").kv_integrity == "on"


class FakeChannel:
    """Stands in for a transport's channel: records what it was asked to send."""

    def __init__(self) -> None:
        self.sent: list[LayerSlice] = []

    def send(self, piece: LayerSlice) -> None:
        self.sent.append(piece)

    def close(self) -> None:
        pass


def staged_slice(transfer_id: str, seq: int) -> LayerSlice:
    data = torch.arange(64, dtype=torch.uint8)
    return LayerSlice(transfer_id, seq, 0, 1, 0, 1, Staged(data, data.numel()), True, seq=seq)


def test_a_running_workers_channels_take_the_fault_file_at_each_transfers_start(
    tmp_path, monkeypatch
):
    """The testing seam (kv_transfer/channels.py): the wrapper the environment names wraps the
    sender's channels, and each transfer gets what the fault file says when it starts."""
    for name, value in injectable_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    channel = FakeChannel()
    opened = wrapped(lambda kind, destination: channel)("grpc", "127.0.0.1:1")
    assert isinstance(opened, FaultyChannel)
    opened.send(staged_slice("before", 0))  # no file yet: no fault
    set_fault(tmp_path, "duplicate:1")
    opened.send(staged_slice("during", 0))
    set_fault(tmp_path, "")
    opened.send(staged_slice("during", 1))  # the transfer keeps the fault it started with
    opened.send(staged_slice("after", 0))
    assert [(p.transfer_id, p.seq) for p in channel.sent] == [
        ("before", 0),
        ("during", 0),
        ("during", 0),
        ("during", 1),
        ("during", 1),
        ("after", 0),
    ]
    # The sender counts each of its slices through once, the copies a fault added not at all.
    assert [(p.transfer_id, p.seq) for p in opened.done(wait=True)] == [
        ("before", 0),
        ("during", 0),
        ("during", 1),
        ("after", 0),
    ]


def test_without_the_seam_set_the_channels_are_the_transports_own(monkeypatch):
    monkeypatch.delenv(CHANNEL_WRAPPER_ENV, raising=False)
    monkeypatch.delenv(FAULT_FILE_ENV, raising=False)
    channel = FakeChannel()
    assert wrapped(lambda kind, destination: channel)("grpc", "127.0.0.1:1") is channel
