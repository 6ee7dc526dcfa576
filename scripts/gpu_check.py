"""Check the KV data plane on a real device, with plain torch (no vLLM needed), in under a minute.

    python scripts/gpu_check.py                 # CUDA when present, else CPU
    python scripts/gpu_check.py --device cpu

1. Round trip, byte-exact: gather a request's blocks from a layer cache -> stage to the host
   (pinned buffer, side stream, event) -> bytes -> back to the device -> scatter into another
   cache, for each layout (vLLM 0.32's view over HND / NHD memory, the older FlashAttention and
   FlashInfer caches) and dtype (bfloat16, float16, float32, fp8 as bytes).
2. Tensor-parallel re-sharding across simulated ranks (2->1, 1->2, 4->2, 1->4 and replicated KV
   heads): every decode rank's cache equals the full cache sliced at its heads.
3. Stream ordering (CUDA): staging sees what the forward stream wrote before it, and a load
   lands after what the forward stream queued before it.
4. The nccl transport's path: KV staged and loaded without leaving the device.
5. Bandwidth: device->pinned and pinned->device copies through the staging code, beside the
   device's own device->device copy, in GB/s (median of repeats).
Exits 1 if any check fails.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer.head_shards import head_routes, rank_heads
from kv_transfer.host_staging import DeviceToHost, HostToDevice
from kv_transfer.kv_copy import as_bytes, from_bytes, gather, scatter, wire_shape
from kv_transfer.kv_layout import (
    BLOCK,
    CONTENT,
    DIM,
    HEAD,
    KV,
    TOKEN,
    LayerLayout,
    find_layout,
    memory_order,
)

# A Llama-70B-like layer shard: 8 KV heads of 128, blocks of 16 tokens (GPU) on 256 blocks.
NUM_BLOCKS, HEADS, BLOCK_TOKENS, HEAD_SIZE = 256, 8, 16, 128
POOL_BYTES = 1 << 30  # pinned host memory for staging: room for the bandwidth buffer
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# (name, logical dims, memory order of those dims)
LAYOUTS = [
    ("vllm-0.32 HND (CPU, FlashInfer)", (BLOCK, HEAD, TOKEN, CONTENT), (0, 1, 2, 3)),
    ("vllm-0.32 NHD (FlashAttention)", (BLOCK, HEAD, TOKEN, CONTENT), (0, 2, 1, 3)),
    ("old FlashAttention", (KV, BLOCK, TOKEN, HEAD, DIM), (0, 1, 2, 3, 4)),
    ("old FlashInfer HND", (KV, BLOCK, HEAD, TOKEN, DIM), (0, 1, 2, 3, 4)),
]


def sizes(dims, heads=HEADS):
    table = {BLOCK: NUM_BLOCKS, HEAD: heads, TOKEN: BLOCK_TOKENS, KV: 2, DIM: HEAD_SIZE}
    table[CONTENT] = 2 * HEAD_SIZE
    return [table[d] for d in dims]


def make_cache(dims, memory, dtype, device, heads=HEADS, fill=True):
    """A cache allocated in `memory` order, viewed in `dims` order, as vLLM hands it out."""
    logical = sizes(dims, heads)
    physical = torch.empty([logical[d] for d in memory], dtype=torch.float32, device=device)
    if fill:
        physical.copy_(torch.randn(physical.shape, device=device))
    else:
        physical.zero_()
    physical = physical.to(dtype)
    return physical.permute(*[memory.index(d) for d in range(len(dims))])


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def round_trip(device, dims, memory, dtype) -> bool:
    source = make_cache(dims, memory, dtype, device)
    layout = find_layout(tuple(source.shape), NUM_BLOCKS, HEADS, BLOCK_TOKENS, HEAD_SIZE)
    target_layout = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))  # a decode worker of another kind
    target = make_cache(target_layout.dims, (0, 2, 1, 3), dtype, device, fill=False)
    src_ids = torch.tensor([17, 3, 250, 99, 42], device=device)
    dst_ids = torch.tensor([5, 6, 7, 200, 1], device=device)
    canonical = layout.canonical(source, HEAD_SIZE)
    staged = DeviceToHost(device, POOL_BYTES).stage(lambda: gather(canonical, src_ids, slice(None)))
    data = bytearray(as_bytes(staged.ready()))
    staged.release()
    host = from_bytes(data, dtype, wire_shape(len(src_ids), HEADS, BLOCK_TOKENS, HEAD_SIZE))
    loader = HostToDevice(device)
    target_canonical = target_layout.canonical(target, HEAD_SIZE)
    loader.load(host, dst_ids.cpu(), lambda w, i: scatter(w, target_canonical, i, slice(None)))
    loader.wait()
    moved = torch.equal(bytes_of(target_canonical[dst_ids]), bytes_of(canonical[src_ids]))
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids.tolist()]
    clean = bool((bytes_of(target_canonical[untouched]) == 0).all())
    return moved and clean and memory_order(source, layout) != ""


def device_resident(device, dtype=torch.bfloat16) -> bool:
    """The nccl transport's path: the wire tensor stays on the device (staged on the side
    stream, ready once its event fires) and is loaded from the device (no host copy)."""
    source = make_cache((BLOCK, HEAD, TOKEN, CONTENT), (0, 2, 1, 3), dtype, device)
    layout = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
    target = make_cache(layout.dims, (0, 2, 1, 3), dtype, device, fill=False)
    src_ids = torch.tensor([4, 90, 11], device=device)
    dst_ids = torch.tensor([7, 8, 200], device=device)
    canonical, target_canonical = (layout.canonical(t, HEAD_SIZE) for t in (source, target))
    staging = DeviceToHost(device, POOL_BYTES)
    staged = staging.stage(lambda: gather(canonical, src_ids, slice(None)), to_host=False)
    received = staged.ready().clone()  # what a receiving rank's group would hand over
    staged.release()
    wire = from_bytes(received, dtype, wire_shape(len(src_ids), HEADS, BLOCK_TOKENS, HEAD_SIZE))
    loader = HostToDevice(device)
    loader.load(wire, dst_ids.cpu(), lambda w, i: scatter(w, target_canonical, i, slice(None)))
    loader.wait()
    moved = torch.equal(bytes_of(target_canonical[dst_ids]), bytes_of(canonical[src_ids]))
    return moved and received.device == device and staging.budget.in_use == 0


def reshard(device, total_heads, prefill_tp, decode_tp, dtype=torch.bfloat16) -> bool:
    layout = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
    full = make_cache(layout.dims, (0, 2, 1, 3), dtype, device, heads=total_heads)
    full_canonical = layout.canonical(full, HEAD_SIZE)
    prefill = [
        full_canonical[:, rank_heads(total_heads, prefill_tp, r).start :][
            :, : len(rank_heads(total_heads, prefill_tp, r))
        ]
        for r in range(prefill_tp)
    ]
    decode = [
        torch.zeros_like(full_canonical[:, : len(rank_heads(total_heads, decode_tp, r))])
        for r in range(decode_tp)
    ]
    ids = torch.tensor([0, 9, 31], device=device)
    for route in head_routes(total_heads, prefill_tp, decode_tp):
        source = route.first_head - rank_heads(total_heads, prefill_tp, route.prefill_rank).start
        target = route.first_head - rank_heads(total_heads, decode_tp, route.decode_rank).start
        wire = gather(prefill[route.prefill_rank], ids, slice(source, source + route.num_heads))
        scatter(wire, decode[route.decode_rank], ids, slice(target, target + route.num_heads))
    return all(
        torch.equal(
            bytes_of(decode[r][ids]),
            bytes_of(
                full_canonical[ids][:, rank_heads(total_heads, decode_tp, r).start :][
                    :, : len(rank_heads(total_heads, decode_tp, r))
                ]
            ),
        )
        for r in range(decode_tp)
    )


def stream_ordering(device) -> bool:
    """On CUDA, with the forward stream busy (a sleep kernel) before it writes the cache: the
    staged copy must see the write (the side stream waits for the forward stream), and a load
    must land after a forward-stream write to the same blocks (the load stream waits too)."""
    layout = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))
    cache = make_cache(layout.dims, (0, 2, 1, 3), torch.bfloat16, device, fill=False)
    canonical = layout.canonical(cache, HEAD_SIZE)
    ids = torch.tensor([3, 4], device=device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the forward stream
    canonical[ids] = 1.0  # the "layer's forward" writes its KV after that
    staged = DeviceToHost(device, POOL_BYTES).stage(lambda: gather(canonical, ids, slice(None)))
    seen_write = bool((staged.ready().view(torch.bfloat16) == 1.0).all())
    staged.release()
    incoming = torch.full_like(canonical[ids], 2.0).cpu()
    torch.cuda._sleep(200_000_000)
    canonical[ids] = 0.0  # vLLM zeroing newly allocated blocks, queued before the load
    loader = HostToDevice(device)
    loader.load(incoming, ids.cpu(), lambda w, i: scatter(w, canonical, i, slice(None)))
    loader.wait()
    torch.cuda.synchronize(device)
    landed_last = bool((canonical[ids] == 2.0).all())
    return seen_write and landed_last


def bandwidth(device, megabytes: int, repeats: int) -> dict[str, float]:
    """GB/s of device->pinned (staging) and pinned->device (loading), and device->device."""
    nbytes = megabytes << 20
    source = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    staging, loader = DeviceToHost(device, max(POOL_BYTES, 2 * nbytes)), HostToDevice(device)
    results: dict[str, list[float]] = {"device->host": [], "host->device": [], "device->device": []}
    target = torch.empty_like(source)
    for _ in range(repeats):
        started = time.perf_counter()
        staged = staging.stage(lambda: source)
        host = staged.ready()
        results["device->host"].append(nbytes / (time.perf_counter() - started) / 1e9)
        wire = host.view(torch.bfloat16)
        started = time.perf_counter()
        loader.load(wire, torch.zeros(1, dtype=torch.long), lambda w, i: target.copy_(w))
        loader.wait()
        results["host->device"].append(nbytes / (time.perf_counter() - started) / 1e9)
        staged.release()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results["device->device"].append(2 * nbytes / (time.perf_counter() - started) / 1e9)
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--megabytes", type=int, default=256, help="bandwidth buffer size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}")
    failures = 0
    for layout_name, dims, memory in LAYOUTS:
        for dtype_name, dtype in DTYPES.items():
            ok = round_trip(device, dims, memory, dtype)
            failures += not ok
            print(f"round trip  {layout_name:<32} {dtype_name:<9} {'ok' if ok else 'FAILED'}")
    for total, p, d in [
        (8, 2, 1),
        (8, 1, 2),
        (8, 4, 2),
        (8, 1, 4),
        (8, 2, 4),
        (2, 1, 4),
        (2, 4, 1),
    ]:
        ok = reshard(device, total, p, d)
        failures += not ok
        print(
            f"re-shard    {total} KV heads, prefill TP {p} -> decode TP {d:<10} "
            f"{'ok' if ok else 'FAILED'}"
        )
    ok = device_resident(device)
    failures += not ok
    print(f"device-resident send and load (the nccl path)               {'ok' if ok else 'FAILED'}")
    if device.type == "cuda":
        ok = stream_ordering(device)
        failures += not ok
        verdict = "ok" if ok else "FAILED"
        print(f"streams     staging after the forward write, load after it  {verdict}")
    rates = bandwidth(device, args.megabytes, args.repeats)
    if device.type == "cpu":  # the wire tensor is the host tensor: nothing is staged
        rates["device->host"] = float("nan")
    print(
        f"bandwidth   {args.megabytes} MiB bfloat16, median of {args.repeats}: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items())
    )
    print("all checks passed" if not failures else f"{failures} check(s) FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
