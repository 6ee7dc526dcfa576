"""GPU check T2 (docs/kv-pool.md, "On GPUs"): the host KV pool's copies never hold vLLM's thread
behind the GPU.

    python3 scripts/gpu_t2_pool_hold.py                 # CUDA when present, else SKIP
    python3 scripts/gpu_t2_pool_hold.py --json t2.json --busy-ms 50
    python3 scripts/gpu_t2_pool_hold.py --device cpu --measure   # the times alone, no verdict

vLLM runs the forward on a dedicated stream per thread, the current one (vllm/utils/
torch_utils.py), and calls the pool's worker (kv_transfer/pool/offload.py) on that thread after
launching the step. This stands in for the step with BUSY_MS of GPU work (`torch.cuda._sleep`)
queued on a dedicated current stream before every call, then times each call of the real copier
(kv_transfer/pool_copy.PoolCopier) for a store and a load job of 8 blocks of a Llama-3.1-8B
bf16 cache as vLLM 0.32 allocates it (32 layers of 64 KiB pages in one buffer; 16 tokens a
block) against a pool mapping registered with CUDA as pinned, as the worker registers the
pool's. A call must return in under LIMIT_MS: one that synchronised (a digest's `.item()`, an
event or stream synchronize) or copied from pageable memory would wait out BUSY_MS. The jobs
are then polled by event query, as the worker's get_finished polls them, and must finish after
the queued work (the copies follow the forward stream) with the bytes exact; a block whose
bytes were changed in the pool is refused and left as it was. It reports the thread's time per
call and per token, the device's time per token (the copy itself, which overlaps the forward),
and the same calls against an unregistered mapping (copies staged through pinned memory).

Torch only: no pydantic, no numpy, no vLLM (a bare GPU image has torch, grpcio and protobuf).
The GPU checks run it as T2 (tests/gpu/test_thread_holds.py, on CUDA):

    check_pool_hold(device) -> str   # raises Unavailable (or `skip`) on CPU, AssertionError
"""

import argparse
import json
import mmap
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer.pool.copy import PoolCopier, PoolMemory, cache_rows
from kv_transfer.pool.store import header_bytes

BUSY_MS = 50.0  # forward work queued before each call
LIMIT_MS = 5.0  # longest a call may hold the thread
LAYERS, PAGE, BLOCK_TOKENS = 32, 64 << 10, 16  # Llama-3.1-8B, bf16, TP 1: 128 KiB a token
JOB_BLOCKS = 8


class Unavailable(Exception):
    """The check cannot run here (a caller may pass its own exception as `skip`)."""


@dataclass
class Holds:
    """What one copier's calls did, repeat by repeat."""

    pinned: bool  # the pool's mapping was registered (else staged)
    blocks: int = JOB_BLOCKS  # a job's
    layers: int = LAYERS
    call_ms: dict[str, list[float]] = field(default_factory=dict)  # store, load, poll, result
    done_ms: dict[str, list[float]] = field(default_factory=dict)  # from the call to the event
    device_us_per_token: dict[str, float] = field(default_factory=dict)  # with nothing queued
    exact: bool = True
    refused_as_expected: bool = True
    register_s: float = 0.0

    def worst(self, call: str) -> float:
        return max(self.call_ms.get(call) or [0.0])


def busy_cycles(device: torch.device, busy_ms: float) -> int:
    """torch.cuda._sleep cycles that keep the current stream busy `busy_ms` (measured)."""
    if busy_ms <= 0:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return int(20_000_000 * busy_ms / max(start.elapsed_time(end), 1e-3))


def measure(
    device: torch.device,
    pinned: bool = True,
    repeats: int = 5,
    busy_ms: float = BUSY_MS,
    layers: int = LAYERS,
    page: int = PAGE,
    blocks: int = JOB_BLOCKS,
) -> Holds:
    """Store and load jobs of `blocks` blocks through a PoolCopier, `repeats` times each, with
    `busy_ms` of work queued on the current stream before every call (CUDA)."""
    cuda = device.type == "cuda"
    cache_blocks = 4 * blocks
    shape = (layers, cache_blocks * page)  # one buffer, a (blocks, page) view per layer
    cache = torch.randint(-128, 128, shape, dtype=torch.int8, device=device)
    pages = [cache_rows(layer.view(cache_blocks, page)) for layer in cache]
    slots = 2 * blocks
    start = header_bytes(slots)
    mapping = mmap.mmap(-1, start + slots * layers * page)
    memory = PoolMemory.over(mapping, start, slots)
    holds = Holds(pinned and cuda, blocks, layers)
    if holds.pinned:
        registration = memory.register(device, wait=True)
        if not registration.ready:
            raise AssertionError(f"the pool's mapping could not be pinned: {registration.error}")
        holds.register_s = registration.seconds
    forward = torch.cuda.Stream(device) if cuda else None
    previous = torch.cuda.current_stream(device) if cuda else None
    if cuda:
        torch.cuda.set_stream(forward)  # a dedicated current stream, as vLLM's forward
    try:
        copier = PoolCopier(pages)
        cycles = busy_cycles(device, busy_ms) if cuda else 0
        keys = [f"block {i}".encode() for i in range(blocks)]
        sources = list(range(blocks))
        targets = list(range(blocks, 2 * blocks))
        placed = list(range(blocks, 2 * blocks))  # one run of slots

        def timed(call: str, run):
            if cycles:
                torch.cuda._sleep(cycles)
            started = time.perf_counter()
            result = run()
            holds.call_ms.setdefault(call, []).append((time.perf_counter() - started) * 1e3)
            return result, started

        def finish(call: str, job, started: float):
            while True:
                polled = time.perf_counter()
                passed = job.passed()
                holds.call_ms.setdefault("poll", []).append((time.perf_counter() - polled) * 1e3)
                if passed:
                    break
                time.sleep(0.0002)
            holds.done_ms.setdefault(call, []).append((time.perf_counter() - started) * 1e3)
            before = time.perf_counter()
            result = job.result()
            holds.call_ms.setdefault("result", []).append((time.perf_counter() - before) * 1e3)
            return result

        for repeat in range(repeats + 1):  # the first one warms up (kernels, pinned buffers)
            job, started = timed("store", lambda: copier.store(sources, memory, placed, keys))
            finish("store", job, started)
            job, started = timed("load", lambda: copier.load(targets, memory, placed, keys))
            _, refused, _ = finish("load", job, started)
            if cuda:
                torch.cuda.synchronize(device)
            stored, loaded = cache[:, : blocks * page], cache[:, blocks * page : 2 * blocks * page]
            holds.exact &= refused == [] and torch.equal(stored, loaded)
            if repeat == 0:
                holds.call_ms.clear()
                holds.done_ms.clear()

        # A changed byte in the pool: that block is refused and left as it was.
        memory.slots[placed[2], 5] ^= 1
        victim = targets[2] + blocks  # load into fresh blocks
        fresh = [target + blocks for target in targets]
        before = torch.stack([p[victim].clone() for p in pages])
        job, started = timed("load", lambda: copier.load(fresh, memory, placed, keys))
        _, refused, refused_keys = finish("load", job, started)
        if cuda:
            torch.cuda.synchronize(device)
        kept = torch.equal(torch.stack([p[victim] for p in pages]), before)
        holds.refused_as_expected = refused == [victim] and refused_keys == [keys[2]] and kept

        # The device's own time per token, nothing queued before it.
        tokens = blocks * BLOCK_TOKENS
        for call, run in (
            ("store", lambda: copier.store(sources, memory, placed, keys)),
            ("load", lambda: copier.load(targets, memory, placed, keys)),
        ):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            job = run()
            job.wait()
            holds.device_us_per_token[call] = (time.perf_counter() - started) * 1e6 / tokens
    finally:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.set_stream(previous)
        if memory.registration is not None:
            memory.registration.release()
    return holds


def summary(holds: Holds, busy_ms: float) -> str:
    tokens = holds.blocks * BLOCK_TOKENS
    calls = ", ".join(
        f"{call} {statistics.median(ms) * 1e3:.0f} us ({statistics.median(ms) * 1e3 / tokens:.1f}"
        f" us/token) worst {max(ms):.2f} ms"
        for call, ms in holds.call_ms.items()
        if call in ("store", "load")
    )
    done = ", ".join(
        f"{call} done after {statistics.median(ms):.1f} ms" for call, ms in holds.done_ms.items()
    )
    device = ", ".join(f"{c} {us:.2f} us/token" for c, us in holds.device_us_per_token.items())
    kind = f"pinned (registered in {holds.register_s:.2f} s)" if holds.pinned else "staged"
    return (
        f"{kind}: thread per call of {holds.blocks} blocks x {holds.layers} layers behind "
        f"{busy_ms:g} ms of queued work: {calls}; {done}; device alone: {device}"
    )


def check_pool_hold(device, skip: type[Exception] = Unavailable, busy_ms: float = BUSY_MS) -> str:
    """T2: every store and load call returns in under LIMIT_MS with `busy_ms` of forward work
    queued, its jobs finish after that work, bit-exact, and a changed block is refused. Raises
    `skip` on a CPU (there a job is copied in the call: no device to queue it on)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise skip("CUDA only: on a CPU a pool job is copied in the call (no device to queue on)")
    pinned = measure(device, True, busy_ms=busy_ms)
    staged = measure(device, False, busy_ms=busy_ms)
    for holds in (pinned, staged):
        if not holds.exact:
            raise AssertionError("the bytes loaded back differ from those stored")
        if not holds.refused_as_expected:
            raise AssertionError("a block whose pool bytes were changed was not refused, or moved")
    for call in ("store", "load", "poll", "result"):
        if pinned.worst(call) > LIMIT_MS:
            raise AssertionError(
                f"a {call} call held the thread {pinned.worst(call):.1f} ms behind {busy_ms:g} ms "
                f"of queued forward work: it waited for the GPU ({summary(pinned, busy_ms)})"
            )
    for call, done in pinned.done_ms.items():
        if min(done) < 0.8 * busy_ms:
            raise AssertionError(
                f"a {call} finished {min(done):.1f} ms after its call, before the {busy_ms:g} ms "
                "of forward work queued first: its copies did not follow the forward stream"
            )
    return f"{summary(pinned, busy_ms)} | {summary(staged, busy_ms)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--busy-ms", type=float, default=BUSY_MS)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="print the copier's times on this device (a CPU too) and check nothing",
    )
    args = parser.parse_args(argv)
    if args.measure:
        device = torch.device(args.device)
        busy_ms = args.busy_ms if device.type == "cuda" else 0.0
        for pinned in (True, False) if device.type == "cuda" else (True,):
            print(summary(measure(device, pinned, busy_ms=busy_ms), busy_ms), flush=True)
        return 0
    started = time.perf_counter()
    try:
        status, detail = "PASS", check_pool_hold(args.device, busy_ms=args.busy_ms)
    except Unavailable as why:
        status, detail = "SKIP", str(why)
    except Exception as error:
        status, detail = "FAIL", f"{type(error).__name__}: {error}"
    seconds = time.perf_counter() - started
    print(f"{status:<4}  T2 kv pool hold on vLLM's thread {seconds:6.2f} s  {detail}", flush=True)
    if args.json:
        result = {"name": "T2 kv pool hold", "status": status, "seconds": round(seconds, 3)}
        args.json.write_text(json.dumps(result | {"detail": detail}, indent=2) + "\n")
    return 1 if status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
