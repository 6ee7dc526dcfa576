"""How long pdserve holds vLLM's thread behind the GPU: the decode loader per transfer
(scripts/bench_loader_hold.py) and T2, the host KV pool's calls (scripts/gpu_t2_pool_hold.py).
On CUDA forward work is queued before every call: a call that synchronised a stream or copied
from pageable memory would wait behind it."""

import pytest
import torch

from tests.gpu.kv_caches import BLOCK_TOKENS, HEAD_SIZE, KV_HEADS, LAYERS
from tests.gpu.script_module import script_module

pytestmark = pytest.mark.gpu

LOADER_BUSY_MS = 50.0  # forward work queued per engine step


def test_the_decode_loader_only_queues_its_copies(device, record_property):
    """On CUDA with LOADER_BUSY_MS of forward work queued each step, the loader only queues its
    copies (pinned receive buffers and indexes, completion by event query); bytes exact on
    every device."""
    bench = script_module("bench_loader_hold")
    shape = bench.Shape(LAYERS * 2, KV_HEADS, HEAD_SIZE, BLOCK_TOKENS, torch.bfloat16, 512)
    busy_ms = LOADER_BUSY_MS if device.type == "cuda" else 0.0
    bench.measure(device, shape, 1, 2, busy_ms)  # warm-up: pinned buffers, kernels
    holds = bench.measure(device, shape, 5, 2, busy_ms)
    assert holds.exact, "loaded bytes differ from those received"
    worst_call_ms = max(holds.per_call_s) * 1e3
    assert not busy_ms or worst_call_ms <= busy_ms / 5, (
        f"a loader call held vLLM's thread {worst_call_ms:.1f} ms behind {busy_ms:g} ms of "
        f"queued forward work: it waited for the GPU ({bench.summary(holds)})"
    )
    record_property("detail", bench.summary(holds))


def test_t2_the_kv_pools_calls_never_wait_for_the_gpu(device, record_property):
    """Each store and load call returns in under 5 ms with 50 ms of forward work queued, its
    job finishes after that work, bit-exact, and a changed block is refused."""
    if device.type != "cuda":
        pytest.skip("CUDA only: on a CPU a pool job is copied in the call (no device to queue on)")
    record_property("detail", script_module("gpu_t2_pool_hold").check_pool_hold(device))
