"""How long the decode worker's KV loader holds vLLM's thread per transfer.

    python scripts/bench_loader_hold.py                    # CUDA when present, else CPU
    python scripts/bench_loader_hold.py --device cpu --transfers 20

vLLM calls the loader (decode_workers/kv_loader.KvLoader.transfer_results) once per engine
step, on the thread that runs the model. This drives the real loader the way that thread does:
each step a few layers' slices have arrived in the real receiver inbox (in receive buffers the
inbox lends, pinned beside CUDA, as the decode connector sets it up), the loader is called, and
on CUDA the step's forward pass is stood in for by `--busy-ms` of GPU work queued on the
forward stream first (the loader's side stream waits for it, so a loader that synchronised, or
copied from pageable memory, would wait for it too), and after the call the step's end is
waited for, outside the loader, as vLLM waits for a step's sampled tokens. A transfer's hold is
the sum of the loader's call times from the step it is expected to the step it is reported.
Prints the median and p90 per transfer (and per call), and checks that every transfer's bytes
landed exactly.

On CPU the scatter itself runs in the call (there is no device to queue it on), so the hold is
the copy time; on CUDA it is the time to queue the copies. Torch only, no vLLM.
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_workers.kv_loader import KvLoader
from kv_transfer.integrity import transfer_epoch
from kv_transfer.kv_layout import BLOCK, CONTENT, HEAD, TOKEN, LayerLayout
from kv_transfer.metadata import Expected
from kv_transfer.transport import Inbox, LayerSlice
from pdserve.bench.metrics import percentile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.uint8}
LAYOUT = LayerLayout((BLOCK, HEAD, TOKEN, CONTENT))  # vLLM 0.32's layer view


@dataclasses.dataclass
class Shape:
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    prompt_tokens: int

    @property
    def blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)


# SmolLM2-135M in float32 on CPU (what the CPU tests serve); a Llama-8B TP shard on CUDA.
CPU_SHAPE = Shape(30, 3, 64, 128, torch.float32, 1536)
CUDA_SHAPE = Shape(32, 8, 128, 16, torch.bfloat16, 1536)


@dataclasses.dataclass
class Holds:
    per_transfer_s: list[float]  # loader call time summed per transfer
    per_call_s: list[float]
    steps_after_last_slice: list[int]  # calls from the last slice's step to the report
    transfer_bytes: int
    exact: bool


def measure(
    device: torch.device,
    shape: Shape,
    transfers: int,
    layers_per_step: int,
    busy_ms: float = 0.0,
) -> Holds:
    """Run `transfers` transfers one after the other through a real KvLoader and Inbox."""
    blocks = shape.blocks
    cache_blocks = 2 * blocks + 1
    caches = [
        torch.zeros(
            cache_blocks,
            shape.kv_heads,
            shape.block_size,
            2 * shape.head_size,
            dtype=shape.dtype,
            device=device,
        )
        for _ in range(shape.layers)
    ]
    inbox = Inbox(verify=False)  # the receiving thread's digest check is not the loader's
    loader = KvLoader(inbox, caches, LAYOUT, shape.head_size, shape.kv_heads)
    inbox.new_buffer = loader.staging.receive_buffer  # as the decode connector does
    wire_shape = (blocks, shape.kv_heads, shape.block_size, 2, shape.head_size)
    width = torch.empty(0, dtype=shape.dtype).element_size()
    count = shape.layers * torch.Size(wire_shape).numel()
    truth = torch.randint(0, 256, (count * width,), dtype=torch.uint8)  # any bits, NaNs too
    truth = truth.view(shape.dtype).view(shape.layers, *wire_shape)
    slice_bytes = truth[0].numel() * truth.element_size()
    cycles = int(busy_ms * 1e-3 * _clock_hz(device)) if device.type == "cuda" else 0
    holds = Holds([], [], [], shape.layers * slice_bytes, True)
    for index in range(transfers):
        transfer_id = f"hold-{index}"
        block_ids = [(index % 2) * blocks + b + 1 for b in range(blocks)]  # alternate halves
        expected = [Expected(f"req-{index}", transfer_id, block_ids, 0, 60.0)]
        held, sent, steps_after = 0.0, 0, 0
        while True:
            for layer in range(sent, min(sent + layers_per_step, shape.layers)):
                inbox.put(_received(inbox, transfer_id, layer, truth[layer], blocks, shape))
            sent = min(sent + layers_per_step, shape.layers)
            if cycles:
                torch.cuda._sleep(cycles)  # the step's forward pass, on the forward stream
            started = time.perf_counter()
            done, failed = loader.transfer_results(expected, set())
            took = time.perf_counter() - started
            holds.per_call_s.append(took)
            held += took
            if cycles:  # vLLM's thread waits for the step's sampled tokens, outside the loader
                torch.cuda.current_stream(device).synchronize()
            expected = []
            if sent == shape.layers:
                steps_after += 1
            if done:
                if failed:
                    raise RuntimeError(f"transfer {transfer_id} failed: {loader.finished[-1:]}")
                break
            if steps_after > 10_000:
                raise RuntimeError(f"transfer {transfer_id} was never reported")
        holds.per_transfer_s.append(held)
        holds.steps_after_last_slice.append(steps_after)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ids = torch.tensor(block_ids, device=device)
        for layer in range(shape.layers):
            landed = LAYOUT.canonical(caches[layer], shape.head_size)[ids]
            if not torch.equal(landed.cpu().view(torch.uint8), truth[layer].view(torch.uint8)):
                holds.exact = False
        loader.take_reports()
    return holds


def _received(inbox: Inbox, transfer_id: str, layer: int, wire, blocks: int, shape: Shape):
    """One layer's slice as a receiver hands it to the inbox: its bytes in a buffer the inbox
    lent (pinned beside CUDA)."""
    raw = wire.reshape(-1).view(torch.uint8)
    buffer = inbox.buffer(raw.numel())
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(raw)
    return LayerSlice(
        transfer_id,
        layer,
        0,
        blocks,
        0,
        shape.kv_heads,
        buffer,
        True,
        time.monotonic(),
        "grpc",
        epoch=transfer_epoch(transfer_id),
        seq=layer,
    )


def _clock_hz(device: torch.device) -> float:
    """The GPU's clock, for torch.cuda._sleep (which counts cycles)."""
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)  # kHz
    return rate * 1e3 if rate else 1.5e9


def summary(holds: Holds) -> str:
    ms = [t * 1e3 for t in holds.per_transfer_s]
    call_ms = [t * 1e3 for t in holds.per_call_s]
    steps = statistics.median(holds.steps_after_last_slice)
    return (
        f"hold per transfer: median {percentile(ms, 50):.2f} ms, p90 {percentile(ms, 90):.2f} ms, "
        f"max {max(ms):.2f} ms; per call: median {percentile(call_ms, 50):.3f} ms, "
        f"p90 {percentile(call_ms, 90):.3f} ms; reported {steps:g}"
        f" step(s) after its last slice (median); bytes exact: {holds.exact}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--transfers", type=int, default=30)
    parser.add_argument("--layers-per-step", type=int, default=6, help="slices arriving per step")
    parser.add_argument("--busy-ms", type=float, default=20.0, help="CUDA: forward work per step")
    parser.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, else bfloat16")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE
    if args.dtype:
        shape = dataclasses.replace(shape, dtype=DTYPES[args.dtype])
    busy_ms = args.busy_ms if device.type == "cuda" else 0.0
    measure(device, shape, 2, args.layers_per_step, busy_ms)  # warm-up: allocations, kernels
    holds = measure(device, shape, args.transfers, args.layers_per_step, busy_ms)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {device} ({name}), torch {torch.__version__}: {args.transfers} transfers of "
        f"{shape.prompt_tokens} tokens ({shape.layers} layers x {shape.blocks} blocks of "
        f"{shape.block_size}, {shape.kv_heads} KV heads x {shape.head_size}, {shape.dtype}), "
        f"{holds.transfer_bytes / 1e6:.1f} MB each, {args.layers_per_step} layers per step"
        + (f", {busy_ms:g} ms of forward work queued per step" if busy_ms else "")
    )
    print(summary(holds))
    return 0 if holds.exact else 1


if __name__ == "__main__":
    sys.exit(main())
