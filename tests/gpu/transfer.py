"""One KV transfer through pdserve's real classes, on a device: the prefill's SendPlan and
LayerSender, a transport's sender and channels, the decode ranks' KvReceiver and KvLoader, on
caches laid out as vLLM 0.32 allocates them; byte-exact on every decode rank."""

import dataclasses
import time
import types

import torch

from decode_workers.kv_loader import KvLoader
from kv_transfer.channels import channel_opener
from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import cancel_transfer, slice_chunk
from kv_transfer.head_shards import rank_heads
from kv_transfer.kv_layout import WIRE_LAYOUT
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.metadata import Expected
from kv_transfer.params import SendKv, to_extra_args
from kv_transfer.transport import KvSender, SliceAssembler
from prefill_workers.kv_sender import LayerSender
from prefill_workers.send_plan import SendPlan
from tests.gpu.kv_caches import (
    BLOCK_TOKENS,
    BLOCKS,
    GQA,
    LAYERS,
    Geometry,
    as_bits,
    layer_layout,
    random_bytes,
    vllm_caches,
)
from tests.kv_faults import faulty, parse_kv_fault

SEND_BUFFER_BYTES = 256 << 20
DEADLINE_S = 30.0  # longest a transfer may take to be reported by every decode rank


@dataclasses.dataclass
class Outcome:
    loaded: bool  # every decode rank reported the transfer, none failed
    exact: bool  # every sent block on every decode rank equals the prefill's
    untouched: bool  # skipped and unsent blocks kept the decode worker's own bytes
    failures: list[str]  # per decode rank: the loader's failure kind ("" when loaded)
    damage: list[str]  # per decode rank: the integrity damage it found
    hold_s: float  # longest time one decode rank's loader held its caller, all steps summed
    received: list[int]  # per decode rank: the KV bytes it loaded


class FakeSchedulerOutput:
    """What SendPlan reads from vLLM's SchedulerOutput, for one request being prefilled."""

    def __init__(self, req_id, scheduled, block_ids, new_request=None) -> None:
        self.num_scheduled_tokens = {req_id: scheduled}
        self.kv_connector_block_state = types.SimpleNamespace(
            get_block_ids=lambda asked: (block_ids,) if asked == req_id else None
        )
        self.scheduled_new_reqs = [new_request] if new_request else []


def start_receivers(compatibility, ranks: int, device) -> tuple[int, list[KvReceiver]]:
    """Decode ranks r = 0.. listen on consecutive ports (rank r on the worker's port + r)."""
    for _ in range(20):
        receivers = [KvReceiver(compatibility)]
        base = receivers[0].start("127.0.0.1", 0)
        try:
            for rank in range(1, ranks):
                receivers.append(KvReceiver(compatibility))
                receivers[-1].start("127.0.0.1", base + rank)
        except Exception:  # that port is taken: try another base
            for receiver in receivers:
                receiver.stop()
            continue
        for receiver in receivers:
            receiver.device = device  # where nccl receives: the cache's device
        return base, receivers
    raise RuntimeError("no run of free ports for the decode ranks")


def transfer(
    device,
    dtype: torch.dtype = torch.bfloat16,
    source: str = "LBNHC",
    target: str = "LBHNC",
    transport: str = "grpc",
    geometry: Geometry = GQA,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    prompt_tokens: int = 5 * BLOCK_TOKENS,
    chunk_tokens: int | None = None,
    skip_blocks: int = 0,
    faults: tuple[str, ...] = ("",),
    decode_device: torch.device | None = None,
    loopback: bool = False,
) -> list[Outcome]:
    """Prefill one prompt per entry of `faults` (each its own transfer, one after the other on
    the same channels, the fault the test's channel wrapper injects: tests/kv_faults.py) of a
    model whose KV is `geometry` (per-head K/V, or an MLA latent) on
    `prefill_tp` ranks with `source` caches, in chunks of `chunk_tokens` (the real SendPlan picks
    each step's blocks), and load it on `decode_tp` ranks with `target` caches (on `decode_device`,
    default `device`); `skip_blocks` are the decode worker's own prefix-cache hit; `loopback`: each
    slice goes from the sender's thread straight to its decode rank's receiving end in this process
    (LoopbackChannel), the network left out. Returns each transfer's outcome."""
    width = torch.empty(0, dtype=dtype).element_size()
    total_heads, head_size = geometry.heads, geometry.head_size
    compatibility = Compatibility(
        "gpu-check",
        str(dtype),
        BLOCK_TOKENS,
        LAYERS,
        total_heads,
        head_size,
        WIRE_LAYOUT,
        "0.32.0",
        geometry.kv_size * head_size * width,
        "none",
    )
    prefill_heads = [rank_heads(total_heads, prefill_tp, r) for r in range(prefill_tp)]
    decode_heads = [rank_heads(total_heads, decode_tp, r) for r in range(decode_tp)]
    prefill = [vllm_caches(source, len(h), dtype, device, geometry) for h in prefill_heads]
    decode_device = decode_device or device
    decode = [vllm_caches(target, len(h), dtype, decode_device, geometry) for h in decode_heads]
    prefill_layout = layer_layout(prefill[0][0], len(prefill_heads[0]), geometry)
    decode_layout = layer_layout(decode[0][0], len(decode_heads[0]), geometry)
    canonical = [[prefill_layout.canonical(c, head_size) for c in rank] for rank in prefill]
    decode_canonical = [[decode_layout.canonical(c, head_size) for c in rank] for rank in decode]
    before = [[as_bits(c) for c in rank] for rank in decode_canonical]
    base, receivers = start_receivers(compatibility, decode_tp, decode_device)

    # Each transfer's fault, injected by the test wrapper around the sender's channels.
    fault_of = {f"check-{i}": parse_kv_fault(fault) for i, fault in enumerate(faults) if fault}

    def sending():
        if not loopback:
            return KvSender(
                faulty(channel_opener(compatibility, "127.0.0.1", device), fault_of.get),
                cancel_transfer,
                num_layers=LAYERS,
                device=device,
            )
        return KvSender(
            faulty(
                lambda kind, destination: LoopbackChannel(
                    receivers[int(destination.rsplit(":", 1)[1]) - base], compatibility
                ),
                fault_of.get,
            ),
            lambda *cancel: None,
            num_layers=LAYERS,
            device=device,
        )

    senders = []
    try:
        for rank in range(prefill_tp):
            senders.append(
                LayerSender(
                    sending(),
                    prefill_layout,
                    head_size,
                    total_heads,
                    prefill_tp,
                    rank,
                    device,
                    SEND_BUFFER_BYTES,
                )
            )
        loaders = [
            KvLoader(receivers[r], decode[r], decode_layout, head_size, total_heads, decode_tp, r)
            for r in range(decode_tp)
        ]
        blocks = -(-prompt_tokens // BLOCK_TOKENS)
        outcomes = []
        for index in range(len(faults)):
            # Distinct blocks per transfer, scattered over the cache, in request order.
            src_ids = [(7 + 5 * (b + index * blocks)) % BLOCKS for b in range(blocks)]
            dst_ids = [(3 + 11 * (b + index * blocks)) % BLOCKS for b in range(blocks)]
            transfer_id = f"check-{index}"
            # What the forward will write: the prompt's KV over every head, per layer (a
            # replicated head, an MLA latent, holds the same KV on each of its ranks).
            shape = (blocks, total_heads, BLOCK_TOKENS, geometry.kv_size, head_size)
            truth = [random_bytes(shape, dtype, device) for _ in range(LAYERS)]
            params = SendKv(transfer_id, f"127.0.0.1:{base}", decode_tp, transport)
            request = types.SimpleNamespace(
                req_id="prefill-req",
                prompt_token_ids=list(range(prompt_tokens)),
                sampling_params=types.SimpleNamespace(extra_args=to_extra_args(params)),
                num_computed_tokens=0,
            )
            plan, done = SendPlan(BLOCK_TOKENS), 0
            while done < prompt_tokens:
                step = min(chunk_tokens or prompt_tokens, prompt_tokens - done)
                sends = plan.sends(
                    FakeSchedulerOutput("prefill-req", step, src_ids, request if not done else None)
                )
                for rank, sender in enumerate(senders):
                    sender.new_step(sends)
                    for layer in range(LAYERS):
                        forward_writes(
                            canonical[rank][layer],
                            truth[layer][:, as_slice(prefill_heads[rank])],
                            src_ids,
                            done,
                            done + step,
                        )
                        sender.save_layer(layer, prefill[rank][layer], sends)
                    sender.fence()
                done += step
            expected = Expected(
                "decode-req", transfer_id, dst_ids, skip_blocks, DEADLINE_S, prefill_tp
            )
            reports = [wait_reported(loader, expected) for loader in loaders]
            stats = [loader.take_reports() for loader in loaders]
            kept = [dst_ids[i] for i in range(blocks) if i >= skip_blocks]
            exact = all(  # the prompt's tokens of every sent block (a last block's tail is unused)
                torch.equal(
                    as_bits(decode_canonical[r][layer][dst_ids[i], :, :valid]),
                    as_bits(truth[layer][i, as_slice(decode_heads[r]), :valid]),
                )
                for r in range(decode_tp)
                for layer in range(LAYERS)
                for i in range(skip_blocks, blocks)
                for valid in [min(BLOCK_TOKENS, prompt_tokens - i * BLOCK_TOKENS)]
            )
            others = [b for b in range(BLOCKS) if b not in kept]
            untouched = all(
                torch.equal(as_bits(decode_canonical[r][layer])[others], before[r][layer][others])
                for r in range(decode_tp)
                for layer in range(LAYERS)
            )
            for r in range(decode_tp):  # the next transfer compares against this one's result
                before[r] = [as_bits(c) for c in decode_canonical[r]]
            failures = [report[1] for report in reports]
            outcomes.append(
                Outcome(
                    loaded=all(not failure for failure in failures),
                    exact=exact,
                    untouched=untouched,
                    failures=failures,
                    damage=[str(s[-1].damage or "") if s else "" for s in stats],
                    hold_s=max(report[2] for report in reports),
                    received=[sum(report.bytes for report in s) for s in stats],
                )
            )
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.stop()
    return outcomes


class LoopbackChannel:
    """The nccl channel with the network left out (test T4, one GPU): each slice's staged tensor
    must still be on the device (staged for nccl: `to_host=False`) with its digest computed there
    by the sending thread (`sealed`); a copy made on a stream of the receiving end's (as NCCL's
    receive writes a fresh buffer) goes through the decode rank's real receiving path:
    SliceAssembler's checks and room, then `deliver`, whose inbox checks the digest on the
    device, and the KV loader scatters from the device tensor."""

    def __init__(self, receiver, compatibility) -> None:
        self.receiver = receiver
        self.assembler = SliceAssembler(receiver.inbox, "nccl", compatibility)
        self.stream = torch.cuda.Stream(receiver.device)

    def send(self, piece) -> None:
        tensor = piece.data.ready()
        if tensor.device.type != "cuda" or piece.data.tensor.device.type != "cuda":
            raise AssertionError("a slice for nccl was staged to the host")
        chunk = slice_chunk(piece, 0, tensor.numel())
        self.assembler.check(chunk, chunk.length)
        self.assembler.carried.begin(chunk.transfer_id)
        self.receiver.inbox.reserve(chunk.length)
        with torch.cuda.stream(self.stream):
            received = tensor.to(self.receiver.device, copy=True)
        self.stream.synchronize()  # as a polled-complete receive: written before it is read
        self.assembler.deliver(chunk, received, reserved=True)

    def close(self) -> None:
        pass


def forward_writes(cache, truth, block_ids, first_token, end_token) -> None:
    """The forward pass of tokens [first_token, end_token) writes their KV into the cache."""
    bits = {1: torch.uint8, 2: torch.int16}[cache.element_size()]  # a copy of bits, not values
    cache, truth = cache.view(bits), truth.view(bits)
    for token in range(first_token, end_token):
        block, offset = divmod(token, BLOCK_TOKENS)
        cache[block_ids[block], :, offset] = truth[block, :, offset]


def as_slice(heads: range) -> slice:
    return slice(heads.start, heads.stop)


def wait_reported(loader, expected) -> tuple[bool, str, float]:
    """Step the loader as vLLM's thread would until it reports the transfer: (reported,
    failure kind or "", seconds its calls held the caller)."""
    held, first = 0.0, [expected]
    deadline = time.monotonic() + DEADLINE_S + 5
    while time.monotonic() < deadline:
        started = time.perf_counter()
        finished, failed = loader.transfer_results(first, set())
        held += time.perf_counter() - started
        first = []
        if expected.req_id in finished:
            if expected.req_id not in failed:
                return True, "", held
            return True, loader.finished[-1].failure if loader.finished else "failed", held
        time.sleep(0.002)
    return False, "not reported", held


def assert_exact(outcome: Outcome) -> str:
    """Fails unless the transfer loaded every sent byte and touched nothing else; says how long
    the loader held its caller."""
    problems = [
        what
        for what, bad in [
            (f"not loaded ({outcome.failures})", not outcome.loaded),
            ("bytes differ", not outcome.exact),
            ("other blocks were written", not outcome.untouched),
        ]
        if bad
    ]
    assert not problems, "; ".join(problems)
    return f"loader held its caller {outcome.hold_s * 1e3:.1f} ms"
