"""Check pdserve's KV data plane on a real device in one short run: the real classes, torch only.

    python scripts/gpu_check.py                          # CUDA when present, else CPU
    python scripts/gpu_check.py --device cpu --json report.json
    python scripts/gpu_check.py --quick                  # a representative subset (unit test)
    python3 scripts/gpu_check.py --json $OUT/gpu_check.json   # the lent GPU machine: ~3-4 min

Every check runs pdserve's own sender -> transport -> receiver -> loader classes
(prefill_workers.kv_sender.LayerSender, kv_transfer.transport.KvSender and its channels,
kv_transfer.kv_receiver.KvReceiver, decode_workers.kv_loader.KvLoader), with the blocks the
prefill's real SendPlan picks, on device tensors laid out as vLLM 0.32 allocates them: one
int8 buffer per layer group viewed as [layers, blocks, heads, tokens, content bytes] in one of
its six KVCacheLayout stride orders, each layer a [blocks, heads, tokens, 2 * head_size] view
(vllm/v1/kv_cache_interface.create_kv_cache_views), plus the older layouts the code still
reads; bfloat16, float16 and fp8 (which vLLM stores as uint8). Byte-exact, on every decode rank.

On CUDA every check's "forward" (what its own thread queues, as vLLM's engine thread does) runs
on a dedicated current stream, as vLLM runs its forward (vllm/utils/torch_utils.py): a check on
the default stream would hide work put on the wrong stream. The GPU tests of issue 46 are
checks too: T1 (scripts/gpu_t1_pg0_kill.py: a pdserve NCCL group whose operation times out
beside a vLLM-like process group 0 leaves the process alive; two processes of ~80 s, started
first and collected last, `--no-t1` leaves it out), T2 (scripts/gpu_t2_pool_hold.py: the host
KV pool's calls return in under 5 ms with 50 ms of forward work queued), T4 (the nccl sending
half on one GPU: staged and digested on the device, received as a device tensor through the
receiver's real checks and loader).

Checks are isolated: each prints its own PASS, FAIL or SKIP line (a failure never stops the
others); `--json PATH` writes them all. A SKIP says why: a CUDA-only check on CPU, nccl with one
GPU (NCCL needs a GPU per rank), or a part another change has "not built yet". Exits 1 if any
check failed.

Dependencies: torch, grpcio and protobuf (what a bare GPU image holds); no pydantic, no numpy,
no vLLM, no network (everything on 127.0.0.1): the data plane's classes import without them
(only the connectors, which this script does not use, subclass vLLM's). Its first lines say
which versions it found, so a failure on an unknown image reads against them.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, BLOCKS, BLOCK_TOKENS, HEAD_SIZE = 3, 48, 16, 128  # a Llama-8B-like layer shard
KV_HEADS = 8
SEND_BUFFER_BYTES = 256 << 20
DEADLINE_S = 30.0  # longest a transfer may take to be reported by every decode rank
PEER_TIMEOUT_S = 3.0  # the group deadline in the peer-never-joins check
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8 (uint8)": torch.uint8}
# vLLM 0.32's KVCacheLayout: the stride order over the logical [L, B, H, N, C] axes.
VLLM_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
OLD_LAYOUTS = {  # per-layer tensors of older vLLM backends (kv_layout.KNOWN_LAYOUTS)
    "old kv,block,token,head,dim": ("kv", "block", "token", "head", "dim"),
    "old kv,block,head,token,dim": ("kv", "block", "head", "token", "dim"),
    "old block,kv,token,head,dim": ("block", "kv", "token", "head", "dim"),
    "old block,kv,head,token,dim": ("block", "kv", "head", "token", "dim"),
}
LAYOUTS = [*VLLM_LAYOUTS, *OLD_LAYOUTS]
# (total KV heads, prefill TP, decode TP): both ways, and 2 heads replicated over 4 ranks
TP_PAIRS = [
    (8, 1, 2),
    (8, 2, 1),
    (8, 1, 4),
    (8, 4, 1),
    (8, 2, 4),
    (8, 4, 2),
    (2, 1, 4),
    (2, 4, 1),
    (2, 2, 4),
    (2, 4, 2),
]
FAULT_DAMAGE = {  # --kv-fault kind -> what the decode worker must find (None: loads fine)
    "corrupt": "digest",
    "truncate": "length",
    "duplicate": "duplicate",
    "reorder": "order",
    "stale": "stale",
    "delay": None,
}


class Skip(Exception):
    """The check cannot run here; the message says why."""


def built(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Caches as vLLM allocates them ---------------------------------------------------------------


def vllm_caches(layout: str, heads: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """One layer group's caches, as vLLM 0.32's create_kv_cache_views makes them: an int8
    buffer, strided by the layout's order over [L, B, H, N, C bytes], one view per layer."""
    content = 2 * HEAD_SIZE * torch.empty(0, dtype=dtype).element_size()
    if layout in OLD_LAYOUTS:
        size = {"kv": 2, "block": BLOCKS, "token": BLOCK_TOKENS, "head": heads, "dim": HEAD_SIZE}
        shape = [size[d] for d in OLD_LAYOUTS[layout]]
        return [random_bytes(shape, dtype, device) for _ in range(LAYERS)]
    shape = (LAYERS, BLOCKS, heads, BLOCK_TOKENS, content)
    strides, step = [0] * 5, 1
    for dim in reversed(VLLM_LAYOUTS[layout]):
        strides[dim], step = step, step * shape[dim]
    raw = torch.randint(0, 256, (step,), dtype=torch.uint8, device=device)
    grouped = torch.as_strided(raw, shape, strides)
    return [grouped[layer].view(dtype) for layer in range(LAYERS)]


def random_bytes(shape, dtype: torch.dtype, device) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def layer_layout(cache: torch.Tensor, heads: int):
    from kv_transfer.kv_layout import find_layout

    return find_layout(tuple(cache.shape), BLOCKS, heads, BLOCK_TOKENS, HEAD_SIZE)


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of any tensor (a copy on the host), for byte-exact comparisons."""
    return tensor.contiguous().view(torch.uint8).cpu()


# One transfer through the real classes ---------------------------------------------------


@dataclasses.dataclass
class Outcome:
    loaded: bool  # every decode rank reported the transfer, none failed
    exact: bool  # every sent block on every decode rank equals the prefill's
    untouched: bool  # skipped and unsent blocks kept the decode worker's own bytes
    failures: list[str]  # per decode rank: the loader's failure kind ("" when loaded)
    damage: list[str]  # per decode rank: the integrity damage it found
    hold_s: float  # longest time one decode rank's loader held its caller, all steps summed


class FakeSchedulerOutput:
    """What SendPlan reads from vLLM's SchedulerOutput, for one request being prefilled."""

    def __init__(self, req_id, scheduled, block_ids, new_request=None) -> None:
        self.num_scheduled_tokens = {req_id: scheduled}
        self.kv_connector_block_state = types.SimpleNamespace(
            get_block_ids=lambda asked: (block_ids,) if asked == req_id else None
        )
        self.scheduled_new_reqs = [new_request] if new_request else []


def start_receivers(compatibility, ranks: int, device):
    """Decode ranks r = 0.. listen on consecutive ports (rank r on the worker's port + r)."""
    from kv_transfer.kv_receiver import KvReceiver

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
    total_heads: int = KV_HEADS,
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
    the same channels, the fault its sender injects) on `prefill_tp` ranks with `source`
    caches, in chunks of `chunk_tokens` (the real SendPlan picks each step's blocks), and load
    it on `decode_tp` ranks with `target` caches (on `decode_device`, default `device`);
    `skip_blocks` are the decode worker's own prefix-cache hit; `loopback`: each slice goes from
    the sender's thread straight to its decode rank's receiving end in this process
    (LoopbackChannel), the network left out. Returns each transfer's outcome."""
    from decode_workers.kv_loader import KvLoader
    from kv_transfer.channels import kv_sender
    from kv_transfer.compatibility import Compatibility
    from kv_transfer.head_shards import rank_heads
    from kv_transfer.kv_layout import WIRE_LAYOUT
    from kv_transfer.metadata import Expected
    from kv_transfer.params import SendKv, to_extra_args
    from prefill_workers.kv_sender import LayerSender
    from prefill_workers.send_plan import SendPlan

    width = torch.empty(0, dtype=dtype).element_size()
    compatibility = Compatibility(
        "gpu-check",
        str(dtype),
        BLOCK_TOKENS,
        LAYERS,
        total_heads,
        HEAD_SIZE,
        WIRE_LAYOUT,
        "0.32.0",
        2 * HEAD_SIZE * width,
        "none",
    )
    prefill_heads = [rank_heads(total_heads, prefill_tp, r) for r in range(prefill_tp)]
    decode_heads = [rank_heads(total_heads, decode_tp, r) for r in range(decode_tp)]
    prefill = [vllm_caches(source, len(h), dtype, device) for h in prefill_heads]
    decode_device = decode_device or device
    decode = [vllm_caches(target, len(h), dtype, decode_device) for h in decode_heads]
    prefill_layout = layer_layout(prefill[0][0], len(prefill_heads[0]))
    decode_layout = layer_layout(decode[0][0], len(decode_heads[0]))
    canonical = [[prefill_layout.canonical(c, HEAD_SIZE) for c in rank] for rank in prefill]
    decode_canonical = [[decode_layout.canonical(c, HEAD_SIZE) for c in rank] for rank in decode]
    before = [[as_bits(c) for c in rank] for rank in decode_canonical]
    base, receivers = start_receivers(compatibility, decode_tp, decode_device)

    def sending():
        if not loopback:
            return kv_sender(compatibility, "127.0.0.1", device)
        from kv_transfer.transport import KvSender

        return KvSender(
            lambda kind, destination: LoopbackChannel(
                receivers[int(destination.rsplit(":", 1)[1]) - base], compatibility
            ),
            lambda *cancel: None,
            num_layers=LAYERS,
            device=device,
        )

    senders = [
        LayerSender(
            sending(),
            prefill_layout,
            HEAD_SIZE,
            total_heads,
            prefill_tp,
            rank,
            device,
            SEND_BUFFER_BYTES,
        )
        for rank in range(prefill_tp)
    ]
    loaders = [
        KvLoader(receivers[r], decode[r], decode_layout, HEAD_SIZE, total_heads, decode_tp, r)
        for r in range(decode_tp)
    ]
    blocks = -(-prompt_tokens // BLOCK_TOKENS)
    outcomes = []
    try:
        for index, fault in enumerate(faults):
            # Distinct blocks per transfer, scattered over the cache, in request order.
            src_ids = [(7 + 5 * (b + index * blocks)) % BLOCKS for b in range(blocks)]
            dst_ids = [(3 + 11 * (b + index * blocks)) % BLOCKS for b in range(blocks)]
            transfer_id = f"check-{index}"
            # What the forward will write: the prompt's KV over every head, per layer (a
            # replicated head holds the same KV on each of its ranks).
            truth = [
                random_bytes((blocks, total_heads, BLOCK_TOKENS, 2, HEAD_SIZE), dtype, device)
                for _ in range(LAYERS)
            ]
            fields = {"fault": fault} if fault else {}
            params = SendKv(transfer_id, f"127.0.0.1:{base}", decode_tp, transport, **fields)
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
            stats = [loader.take_stats() for loader in loaders]
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
                    damage=[str(s[-1].get("integrity", "")) if s else "" for s in stats],
                    hold_s=max(report[2] for report in reports),
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
        from kv_transfer.transport import SliceAssembler

        self.receiver = receiver
        self.assembler = SliceAssembler(receiver.inbox, "nccl", compatibility)
        self.stream = torch.cuda.Stream(receiver.device)

    def send(self, piece) -> None:
        from kv_transfer.grpc_transport import slice_chunk

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
            return True, loader.finished[-1]["failure"] if loader.finished else "failed", held
        time.sleep(0.002)
    return False, "not reported", held


def exact_outcome(outcome: Outcome) -> str:
    problems = [
        what
        for what, bad in [
            (f"not loaded ({outcome.failures})", not outcome.loaded),
            ("bytes differ", not outcome.exact),
            ("other blocks were written", not outcome.untouched),
        ]
        if bad
    ]
    if problems:
        raise AssertionError("; ".join(problems))
    return f"loader held its caller {outcome.hold_s * 1e3:.1f} ms"


# Checks ------------------------------------------------------------------------------------


def check_layout(device, source: str, dtype: torch.dtype) -> str:
    target = LAYOUTS[(LAYOUTS.index(source) + 1) % len(LAYOUTS)]  # into another layout
    (outcome,) = transfer(device, dtype, source, target)
    return f"into {target}: " + exact_outcome(outcome)


def check_transport(device, transport: str) -> str:
    decode_device = device
    if transport == "nccl" and device.type == "cuda":
        if torch.cuda.device_count() < 2:
            raise Skip("NCCL needs a GPU per rank: one GPU here")
        decode_device = torch.device("cuda", (device.index or 0) + 1)
    (outcome,) = transfer(device, transport=transport, decode_device=decode_device)
    return exact_outcome(outcome)


def check_device_send(device, prefill_tp: int = 1, decode_tp: int = 1) -> str:
    """T4: the nccl transport's sending half on one GPU (its two-GPU run is `transport nccl`):
    staged on the device, digest computed there by the sending thread, received as a device
    tensor whose digest the inbox checks on the device, scattered from the device."""
    if device.type != "cuda":
        raise Skip("CUDA only (on CPU the nccl transport sends host tensors over gloo)")
    (outcome,) = transfer(
        device, transport="nccl", prefill_tp=prefill_tp, decode_tp=decode_tp, loopback=True
    )
    return "staged and checked on the device; " + exact_outcome(outcome)


def check_chunked_prefill(device) -> str:
    """Chunks of 1.5 blocks: every step ends mid-block, the partial block is sent again."""
    (outcome,) = transfer(
        device, prompt_tokens=5 * BLOCK_TOKENS + 3, chunk_tokens=BLOCK_TOKENS + BLOCK_TOKENS // 2
    )
    return exact_outcome(outcome)


def check_prefix_skip(device) -> str:
    (outcome,) = transfer(device, skip_blocks=2)
    return exact_outcome(outcome)


def check_tp(device, heads: int, prefill_tp: int, decode_tp: int) -> str:
    (outcome,) = transfer(device, total_heads=heads, prefill_tp=prefill_tp, decode_tp=decode_tp)
    return exact_outcome(outcome)


def check_digest_on_device(device) -> str:
    if not built("kv_transfer.integrity"):
        raise Skip("not built yet: kv_transfer/integrity.py")
    from kv_transfer.integrity import slice_digest

    data = torch.randint(0, 256, ((3 << 20) + 5,), dtype=torch.uint8, device=device)
    here, on_host = slice_digest(data), slice_digest(data.cpu())
    flipped = data.clone()
    flipped[12345] ^= 4
    if here != on_host:
        raise AssertionError(f"{device.type} digest {here:#x} != CPU digest {on_host:#x}")
    if slice_digest(flipped) == here:
        raise AssertionError("a flipped bit left the digest unchanged")
    started = time.perf_counter()
    for _ in range(5):
        slice_digest(data)
    rate = 5 * data.numel() / (time.perf_counter() - started) / 1e9
    return f"equal to the CPU's, a flipped bit caught, {rate:.1f} GB/s"


def check_kv_pool(device) -> str:
    """The host KV pool's copy path (kv_transfer/pool/copy.py) through a real store process, for
    an engine of two tensor-parallel ranks: each rank's blocks of a bfloat16 and an fp8 (uint8)
    cache on the device go into its part of the slots and come back bit for bit into another
    cache's blocks; a byte changed in one rank's part is refused by that rank alone (its block
    left as it was), and the other rank still loads its part."""
    if not built("kv_transfer.pool.copy"):
        raise Skip("not built yet: kv_transfer/pool/copy.py")
    from kv_transfer.pool.client import PoolClient
    from kv_transfer.pool.copy import PoolMemory, cache_rows, load_blocks, store_blocks
    from kv_transfer.pool.wire import CompleteStore, PrepareLoad, PrepareStore
    from pdserve.cluster.local_services import start_kv_pool
    from pdserve.worker.processes import stop_group

    page, ranks = 256 << 10, 2  # one block's bytes in each cache of a rank
    caches = [
        [random_bytes((BLOCKS, page // 2), torch.bfloat16, device)]
        + [random_bytes((BLOCKS, page), torch.uint8, device)]
        for _ in range(ranks)
    ]
    targets = [[torch.zeros_like(cache) for cache in rank] for rank in caches]
    keys = tuple(f"block {i}".encode() for i in range(4))
    sources, destinations = [1, 3, 5, 7], [0, 2, 4, 6]
    slot = ranks * 2 * page
    log_path = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "kv-pool.log"
    address, store = start_kv_pool(log_path, len(keys) * slot)
    try:
        writer, reader = (
            PoolClient(address, "gpu_check", slot, ranks),
            PoolClient(address, "gpu_check", slot, ranks),
        )
        slots = writer.call(PrepareStore(keys)).stored.slots
        memory = PoolMemory.over(writer.memory, writer.header_bytes, writer.slots, ranks)
        started = time.perf_counter()
        for rank, rank_caches in enumerate(caches):
            pages = [cache_rows(c) for c in rank_caches]
            store_blocks(pages, sources, memory, slots, keys, rank)
        stored_s = time.perf_counter() - started
        writer.call(CompleteStore(keys, success=True))
        loaded_slots = reader.call(PrepareLoad(keys)).slots
        memory = PoolMemory.over(reader.memory, reader.header_bytes, reader.slots, ranks)
        started = time.perf_counter()
        for rank, rank_targets in enumerate(targets):
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, destinations, memory, loaded_slots, keys, rank)
            if refused:
                raise AssertionError(f"rank {rank}: intact blocks refused: {refused}")
        loaded_s = time.perf_counter() - started
        for rank_caches, rank_targets in zip(caches, targets, strict=True):
            for cache, target in zip(rank_caches, rank_targets, strict=True):
                for source, destination in zip(sources, destinations, strict=True):
                    if not torch.equal(as_bits(cache[source]), as_bits(target[destination])):
                        raise AssertionError(f"block {source} came back changed")
        memory.part(loaded_slots[0], 1)[5] ^= 1
        for rank, rank_targets in enumerate(targets):
            before = as_bits(rank_targets[0][1])
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, [1], memory, loaded_slots[:1], keys[:1], rank)
            if rank == 1 and (
                refused != [1] or not torch.equal(as_bits(rank_targets[0][1]), before)
            ):
                raise AssertionError("a changed byte in rank 1's part was loaded")
            if rank == 0 and refused:
                raise AssertionError(
                    "rank 0 refused its intact part of a slot rank 1's was changed in"
                )
        writer.close()
        reader.close()
    finally:
        stop_group(store.pid, process=store)
    rate = len(keys) * slot / 1e9
    return (
        f"bit-exact for 2 ranks' parts, a changed byte refused by its rank alone; "
        f"store {rate / stored_s:.2f} GB/s, load {rate / loaded_s:.2f} GB/s (with the digest)"
    )


def check_kv_pool_peer(device) -> str:
    """A fetch between two hosts' KV pools (kv_transfer/pool/peer.py; what two workers' gRPC
    carries between them is left out): blocks a 2-rank engine stored from its device caches into
    one store are read out of it, written into another store and checked there, and another
    2-rank engine loads them onto the device bit for bit; a bit flipped in the first store's
    memory makes that block fail its check on arrival, and it never becomes loadable."""
    if not built("kv_transfer.pool.peer"):
        raise Skip("not built yet: kv_transfer/pool/peer.py")
    from kv_transfer.pool.client import PoolClient
    from kv_transfer.pool.copy import PoolMemory, cache_rows, load_blocks, store_blocks
    from kv_transfer.pool.peer import BlockWriter, Damaged, read_blocks
    from kv_transfer.pool.wire import (
        PEER,
        CompleteLoad,
        CompleteStore,
        Drop,
        Lookup,
        PrepareLoad,
        PrepareStore,
    )
    from pdserve.cluster.local_services import start_kv_pool
    from pdserve.worker.processes import stop_group

    page, ranks = 256 << 10, 2
    caches = [[random_bytes((BLOCKS, page), torch.uint8, device)] for _ in range(ranks)]
    targets = [[torch.zeros_like(rank[0])] for rank in caches]
    keys = tuple(f"peer block {i}".encode() for i in range(4))
    blocks = [1, 3, 5, 7]
    slot = ranks * page
    stores = []
    try:
        addresses = []
        for name in ("source", "destination"):
            log_path = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-")) / "kv-pool.log"
            address, store = start_kv_pool(log_path, len(keys) * slot)
            addresses.append(address)
            stores.append(store)
        engines = [PoolClient(address, "gpu_check", slot, ranks) for address in addresses]
        slots = engines[0].call(PrepareStore(keys)).stored.slots
        memory = PoolMemory.over(engines[0].memory, engines[0].header_bytes, len(keys), ranks)
        for rank, rank_caches in enumerate(caches):
            store_blocks([cache_rows(c) for c in rank_caches], blocks, memory, slots, keys, rank)
        engines[0].call(CompleteStore(keys, success=True))
        engines[1].connected()  # the destination pool's namespace, as its engine would set it
        source, destination = PoolClient(addresses[0], PEER), PoolClient(addresses[1], PEER)
        started = time.perf_counter()
        writer = BlockWriter(destination, keys)
        for chunk in read_blocks(source, writer.wanted):
            writer.write(chunk)
        fetched = writer.finish()
        fetch_s = time.perf_counter() - started
        if fetched != len(keys):
            raise AssertionError(f"{fetched} of {len(keys)} blocks fetched")
        loaded = engines[1].call(PrepareLoad(keys)).slots
        target_memory = PoolMemory.over(
            engines[1].memory, engines[1].header_bytes, len(keys), ranks
        )
        for rank, rank_targets in enumerate(targets):
            pages = [cache_rows(t) for t in rank_targets]
            _, refused, _ = load_blocks(pages, blocks, target_memory, loaded, keys, rank)
            if refused:
                raise AssertionError(f"rank {rank}: fetched blocks refused: {refused}")
            if not torch.equal(rank_targets[0][blocks], caches[rank][0][blocks]):
                raise AssertionError(f"rank {rank}: fetched blocks came back changed")
        engines[1].call(CompleteLoad(keys))
        memory.part(slots[0], 1)[5] ^= 1  # the source's first block, rank 1's part
        engines[1].call(Drop(keys))
        writer = BlockWriter(destination, keys)
        try:
            for chunk in read_blocks(source, writer.wanted):
                writer.write(chunk)
            raise AssertionError("a block with a flipped bit passed its check on arrival")
        except Damaged:
            pass
        if writer.finish() or engines[1].call(Lookup(keys)).blocks:
            raise AssertionError("a damaged block became loadable")
    finally:
        for store in stores:
            stop_group(store.pid, process=store)
    rate = len(keys) * slot / fetch_s / 1e9
    return f"bit-exact for 2 ranks' parts, a flipped bit refused on arrival; {rate:.2f} GB/s"


def check_fault(device, kind: str) -> str:
    from kv_transfer.params import SendKv

    if "fault" not in {f.name for f in dataclasses.fields(SendKv)}:
        raise Skip("not built yet: fault injection (SendKv.fault)")
    # A stale slice is one kept from the transfer before (its sender marked for the fault too).
    first = f"{kind}:1" if kind == "stale" else ""
    clean, faulty = transfer(device, faults=(first, f"{kind}:1"))
    exact_outcome(clean)
    want = FAULT_DAMAGE[kind]
    if want is None:
        return exact_outcome(faulty)
    if faulty.loaded or want not in faulty.damage:
        raise AssertionError(f"expected an integrity failure ({want}), got {faulty}")
    return f"refused as {want} on every rank, nothing loaded"


def check_lifetime_race(device) -> str:
    """The nccl receive path on CUDA: a received slice's device buffer (and the copy of its kept
    blocks, `wire[keep]`, after a prefix-cache skip) is freed to the caching allocator once the
    loader has queued its scatter on the loader's side stream; unless something holds it until
    that stream has read it, the next allocation can overwrite it first. Made deterministic:
    the side stream sleeps before each scatter, and the freed memory is filled with 0xFF."""
    if device.type != "cuda":
        raise Skip("CUDA only (on CPU the scatter happens at once)")
    bad = {skip: _race(device, skip) for skip in (0, 1)}
    if any(bad.values()):
        raise AssertionError(
            "blocks overwritten before their scatter read them: "
            + "; ".join(f"skip {skip}: layers {layers}" for skip, layers in bad.items() if layers)
        )
    return "every layer's blocks intact, with and without a prefix-cache skip"


def _race(device, skip: int) -> list[int]:
    """The layers whose loaded blocks differ from what was received."""
    from decode_workers.kv_loader import KvLoader
    from kv_transfer.metadata import Expected
    from kv_transfer.transport import Inbox

    caches = vllm_caches("LBNHC", KV_HEADS, torch.bfloat16, device)
    layout = layer_layout(caches[0], KV_HEADS)
    inbox = Inbox()
    loader = KvLoader(inbox, caches, layout, HEAD_SIZE, KV_HEADS)
    ids = [4, 9, 30]
    loader.transfer_results([Expected("req", "race", ids, skip, DEADLINE_S)], set())
    shape = (len(ids), KV_HEADS, BLOCK_TOKENS, 2, HEAD_SIZE)
    wires = [
        random_bytes(shape, torch.bfloat16, device).view(torch.uint8).reshape(-1)
        for _ in range(LAYERS)
    ]
    received = [as_bits(w.view(torch.bfloat16).view(shape)[skip:]) for w in wires]
    torch.cuda.synchronize(device)
    for layer in range(LAYERS - 1):  # loaded, not complete: nothing waits for the side stream
        inbox.put(_device_slice("race", layer, wires[layer], len(ids)))
        with torch.cuda.stream(loader.staging.stream):
            torch.cuda._sleep(100_000_000)  # the scatter queued next waits behind this
        loader.transfer_results([], set())
    del wires[: LAYERS - 1]  # the receiver's references: gone once the slice is released
    junk = [torch.empty_like(wires[0]).fill_(0xFF) for _ in range(2 * LAYERS)]  # next receives
    inbox.put(_device_slice("race", LAYERS - 1, wires[0], len(ids)))
    deadline = time.monotonic() + DEADLINE_S
    while "req" not in loader.transfer_results([], set())[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    del junk
    torch.cuda.synchronize(device)
    canonical = [layout.canonical(c, HEAD_SIZE) for c in caches]
    return [
        layer
        for layer in range(LAYERS)
        if not torch.equal(as_bits(canonical[layer][ids[skip:]]), received[layer])
    ]


def _device_slice(transfer_id: str, layer: int, wire: torch.Tensor, blocks: int):
    """A received slice as the nccl transport hands it over: a uint8 tensor on the device,
    with its integrity fields where the receiver checks them."""
    from kv_transfer.transport import LayerSlice

    fields = {}
    if built("kv_transfer.integrity"):
        from kv_transfer.integrity import slice_digest, transfer_epoch

        fields = {"epoch": transfer_epoch(transfer_id), "seq": layer, "digest": slice_digest(wire)}
    return LayerSlice(
        transfer_id, layer, 0, blocks, 0, KV_HEADS, wire, True, time.monotonic(), "nccl", **fields
    )


PEER_NEVER_JOINS = textwrap.dedent(
    """
    import sys, threading, time, torch
    from datetime import timedelta
    from torch.distributed import TCPStore
    from kv_transfer.nccl_transport import WATCHDOG_FACTOR, PairGroup, rendezvous

    backend, timeout_s, case = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")

    def store(port=0, master=True):
        return TCPStore("127.0.0.1", port, world_size=2, is_master=master,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    master = store()
    if case == "communicator":  # the peer checks in on the store, then makes no communicator
        peer = store(master.port, master=False)
        threading.Thread(target=rendezvous, args=(peer, 1, timeout_s), daemon=True).start()
    started = time.monotonic()
    try:
        group = PairGroup(master, backend, 0, "127.0.0.1", device, timeout_s)
        group.send(torch.ones(1024, device=device))
        print("no error: the send completed with no peer")
    except Exception as error:
        took = time.monotonic() - started
        alive = ""
        if backend == "nccl":  # stay until torch's watchdog would have fired (gloo has none)
            time.sleep(max(0.0, timeout_s * WATCHDOG_FACTOR + 2 - took))
            alive = ", alive past the watchdog's timeout"
        print(f"raised after {took:.1f} s{alive}: {type(error).__name__}: {error}")
    """
)


def check_peer_never_joins(device, case: str) -> str:
    """A pairwise group (kv_transfer/nccl_transport.PairGroup) whose peer never joins the store
    (`case` "store") or joins it and never makes its communicator ("communicator": on CUDA,
    NCCL's own creation must be bounded) must raise within its deadline, in a process of its
    own: not hang, and not be aborted by torch's watchdog afterwards (the process stays past
    the watchdog's timeout and exits cleanly)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    limit = 6 * PEER_TIMEOUT_S + 30  # the process start, imports and the watchdog wait included
    try:
        done = subprocess.run(
            [sys.executable, "-c", PEER_NEVER_JOINS, backend, str(PEER_TIMEOUT_S), case],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"{backend}: hung past {limit:g} s (deadline {PEER_TIMEOUT_S:g} s)"
        ) from None
    said = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]]
    if done.returncode != 0:
        raise AssertionError(f"{backend}: the process died (exit {done.returncode}): {said[0]}")
    if not said[0].startswith("raised after"):
        raise AssertionError(f"{backend}: {said[0]}")
    seconds = float(said[0].split()[2])
    if seconds > 2 * PEER_TIMEOUT_S + 5:
        raise AssertionError(f"{backend}: raised only after {seconds:g} s: {said[0]}")
    return f"{backend}, deadline {PEER_TIMEOUT_S:g} s: {said[0][:200]}"


def check_stream_ordering(device) -> str:
    """With the forward stream busy before it writes the cache: the staged copy must see the
    write (the side stream waits for the forward stream), and a load must land after a
    forward-stream write to the same blocks (the load stream waits too)."""
    if device.type != "cuda":
        raise Skip("CUDA only (one stream on CPU)")
    from kv_transfer.host_staging import DeviceToHost, HostToDevice
    from kv_transfer.kv_copy import gather, scatter

    cache = vllm_caches("LBNHC", KV_HEADS, torch.bfloat16, device)[0]
    canonical = layer_layout(cache, KV_HEADS).canonical(cache, HEAD_SIZE)
    ids = torch.tensor([3, 4], device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(200_000_000)
    canonical[ids] = 1.0  # the layer's forward writes its KV after that
    staged = DeviceToHost(device, SEND_BUFFER_BYTES).stage(
        lambda: gather(canonical, ids, slice(None))
    )
    seen_write = bool((staged.ready().view(torch.bfloat16) == 1.0).all())
    staged.release()
    incoming = torch.full_like(canonical[ids], 2.0).cpu()
    torch.cuda._sleep(200_000_000)
    canonical[ids] = 0.0  # vLLM zeroing newly allocated blocks, queued before the load
    loader = HostToDevice(device)
    loader.load(incoming, ids.cpu(), lambda w, i: scatter(w, canonical, i, slice(None)))
    loader.wait()
    torch.cuda.synchronize(device)
    if not seen_write:
        raise AssertionError("the staged copy ran before the forward stream's write")
    if not bool((canonical[ids] == 2.0).all()):
        raise AssertionError("the load landed before the forward stream's write")
    return "staging after the forward write, load after it"


def script(name: str):
    """A module of scripts/ (the GPU tests T1 and T2 live in scripts of their own)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def check_pool_hold(device) -> str:
    """T2 (scripts/gpu_t2_pool_hold.py): the host KV pool's copies never hold vLLM's thread
    behind queued forward work."""
    return script("gpu_t2_pool_hold").check_pool_hold(device, skip=Skip)


_T1: dict[str, object] = {}


def start_pg0_check(device) -> None:
    """Start T1's two processes (~80 s, mostly waiting) so they run beside the other checks."""
    if device.type == "cuda":
        _T1.setdefault(str(device), script("gpu_t1_pg0_kill").Pg0Check(device, skip=Skip))
        _T1[str(device)].start()


def check_pg0_survives(device) -> str:
    """T1 (scripts/gpu_t1_pg0_kill.py): a pdserve NCCL group whose operation times out beside a
    vLLM-like process group 0 leaves the process alive (review §3.1)."""
    if device.type != "cuda":
        raise Skip("CUDA only: torch's ProcessGroupNCCL watchdog and heartbeat monitor")
    start_pg0_check(device)
    return _T1[str(device)].result()


LOADER_BUSY_MS = 50.0  # forward work queued per engine step in the loader hold check


def check_loader_hold(device) -> str:
    """How long the decode loader holds vLLM's thread per transfer (scripts/bench_loader_hold.py
    drives the real KvLoader and inbox as vLLM's thread does). On CUDA, with LOADER_BUSY_MS of
    forward work queued each step, the loader only queues its copies (pinned receive buffers
    and indexes, completion by event query): a loader that synchronised its stream or copied
    from pageable memory would wait behind that work in every call. Bytes exact everywhere."""
    bench = script("bench_loader_hold")
    shape = bench.Shape(LAYERS * 2, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, torch.bfloat16, 512)
    busy_ms = LOADER_BUSY_MS if device.type == "cuda" else 0.0
    bench.measure(device, shape, 1, 2, busy_ms)  # warm-up: pinned buffers, kernels
    holds = bench.measure(device, shape, 5, 2, busy_ms)
    if not holds.exact:
        raise AssertionError("loaded bytes differ from those received")
    worst_call_ms = max(holds.per_call_s) * 1e3
    if busy_ms and worst_call_ms > busy_ms / 5:
        raise AssertionError(
            f"a loader call held vLLM's thread {worst_call_ms:.1f} ms behind {busy_ms:g} ms of "
            f"queued forward work: it waited for the GPU ({bench.summary(holds)})"
        )
    return bench.summary(holds)


def check_bandwidth(device, megabytes: int, repeats: int) -> str:
    """GB/s of device->pinned (staging) and pinned->device (loading) through the real staging
    classes, beside the device's own device->device copy (median of repeats)."""
    from kv_transfer.host_staging import DeviceToHost, HostToDevice

    nbytes = megabytes << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    staging = DeviceToHost(device, 2 * nbytes + (1 << 20))
    loader = HostToDevice(device)
    rates: dict[str, list[float]] = {"D2H": [], "H2D": [], "D2D": []}

    def timed(name: str, run: Callable[[], object], moved: int = nbytes) -> object:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates[name].append(moved / (time.perf_counter() - started) / 1e9)
        return result

    index = torch.zeros(1, dtype=torch.long)
    for _ in range(repeats):
        staged = timed("D2H", lambda: staging.stage(lambda: source))  # the copy, synced
        host = staged.ready()
        timed(
            "H2D",
            lambda host=host: (
                loader.load(host, index, lambda w, i: target.copy_(w)),
                loader.wait(),
            ),
        )
        staged.release()
        timed("D2D", lambda: target.copy_(source), 2 * nbytes)
    if not torch.equal(target, source):
        raise AssertionError("the bytes loaded back differ from those staged")
    if device.type == "cpu":  # the wire tensor is the host tensor: nothing is staged
        del rates["D2H"]
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return f"{megabytes} MiB, median of {repeats}: " + ", ".join(
        f"{name} {rate:.1f} GB/s" for name, rate in medians.items()
    )


def checks(device, quick: bool, megabytes: int, repeats: int) -> list[tuple[str, Callable]]:
    """Every check, by name: (name, run() -> detail)."""
    layouts = ["LBHNC", "BHLNC", "old kv,block,token,head,dim"] if quick else LAYOUTS
    found = []
    for layout in layouts:
        for dtype_name, dtype in DTYPES.items():
            found.append(
                (
                    f"layout {layout} {dtype_name}",
                    lambda name=layout, d=dtype: check_layout(device, name, d),
                )
            )
    for transport in ("grpc", "shm", "nccl"):
        found.append((f"transport {transport}", lambda t=transport: check_transport(device, t)))
    for p, d in ((1, 1), (2, 1), (1, 2)):
        found.append(
            (
                f"T4 nccl sending half on the device, TP {p} -> {d}",
                lambda p=p, d=d: check_device_send(device, p, d),
            )
        )
    found.append(("chunked prefill, mid-block boundary", lambda: check_chunked_prefill(device)))
    found.append(("prefix-cache skip", lambda: check_prefix_skip(device)))
    for heads, p, d in TP_PAIRS[:4] + TP_PAIRS[6:8] if quick else TP_PAIRS:
        found.append(
            (
                f"tp {heads} KV heads, prefill TP {p} -> decode TP {d}",
                lambda h=heads, p=p, d=d: check_tp(device, h, p, d),
            )
        )
    found.append(("integrity digest on the device", lambda: check_digest_on_device(device)))
    found.append(("kv pool store and load", lambda: check_kv_pool(device)))
    found.append(("kv pool fetch between hosts", lambda: check_kv_pool_peer(device)))
    for kind in FAULT_DAMAGE:
        found.append((f"fault {kind}", lambda k=kind: check_fault(device, k)))
    found.append(("nccl receive buffer lifetime race", lambda: check_lifetime_race(device)))
    found.append(("group whose peer never joins", lambda: check_peer_never_joins(device, "store")))
    found.append(
        (
            "group whose peer never makes its communicator",
            lambda: check_peer_never_joins(device, "communicator"),
        )
    )
    found.append(("stream ordering", lambda: check_stream_ordering(device)))
    found.append(("decode loader hold on vLLM's thread", lambda: check_loader_hold(device)))
    found.append(("T2 kv pool hold on vLLM's thread", lambda: check_pool_hold(device)))
    found.append(("bandwidth", lambda: check_bandwidth(device, megabytes, repeats)))
    found.append(
        ("T1 process group 0 survives a KV group's failure", lambda: check_pg0_survives(device))
    )
    return found


def run_check(name: str, run: Callable[[], str], device=None) -> dict:
    """One check, its "forward" (this thread's work) on a dedicated current stream on CUDA, as
    vLLM runs its forward (vllm/utils/torch_utils.py): a check that used the default stream
    would hide work put on the wrong stream."""
    started = time.perf_counter()
    try:
        with forward_stream(device):
            status, detail = "PASS", run()
    except Skip as why:
        status, detail = "SKIP", str(why)
    except Exception as error:
        status = "FAIL"
        detail = f"{type(error).__name__}: {error}"
        last = traceback.extract_tb(error.__traceback__)[-1]
        detail += f" (at {Path(last.filename).name}:{last.lineno})"
    seconds = time.perf_counter() - started
    print(f"{status:<4}  {name:<44} {seconds:6.2f} s  {detail}", flush=True)
    return {"name": name, "status": status, "seconds": round(seconds, 3), "detail": detail}


@contextlib.contextmanager
def forward_stream(device):
    """A fresh stream as this thread's current one on CUDA, the default one back after."""
    if device is None or device.type != "cuda":
        yield
        return
    torch.cuda.set_stream(torch.cuda.Stream(device))
    try:
        yield
    finally:
        torch.cuda.current_stream(device).synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream(device))


def versions() -> dict[str, str]:
    """What this machine has of what the data plane needs (and of what it must do without)."""
    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    found["cuda"] = str(torch.version.cuda)
    found["nccl"] = (
        ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    )
    for module in ("grpc", "google.protobuf", "pydantic", "numpy", "vllm"):
        try:
            found[module] = getattr(importlib.import_module(module), "__version__", "?")
        except ImportError:
            found[module] = "absent"
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write every check's result here")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--megabytes", type=int, help="bandwidth buffer (default 256, CPU 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--verbose", action="store_true", help="show pdserve's own logs")
    parser.add_argument(
        "--no-t1", action="store_true", help="leave out T1 (~80 s; scripts/gpu_t1_pg0_kill.py)"
    )
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    else:  # the fault checks make pdserve log every injected fault and refusal
        logging.getLogger("pdserve").addHandler(logging.NullHandler())
        logging.getLogger("pdserve").propagate = False
    device = torch.device(args.device)
    megabytes = args.megabytes or (256 if device.type == "cuda" else 64)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    print(f"device {device} ({name}), torch {torch.__version__}", flush=True)
    if device.type == "cuda":
        print("every check's forward runs on a dedicated stream, as vLLM's does", flush=True)
    started = time.perf_counter()
    if not args.quick and not args.no_t1:
        start_pg0_check(device)  # T1's processes run beside the other checks
    found_checks = checks(device, args.quick, megabytes, args.repeats)
    if args.quick or args.no_t1:
        found_checks = [(n, run) for n, run in found_checks if not n.startswith("T1 ")]
    results = [run_check(n, run, device) for n, run in found_checks]
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    total = time.perf_counter() - started
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
        f"in {total:.1f} s"
    )
    if args.json:
        report = {
            "device": str(device),
            "device_name": name,
            "torch": torch.__version__,
            "versions": found,
            "quick": args.quick,
            "seconds": round(total, 1),
            "counts": counts,
            "checks": results,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
