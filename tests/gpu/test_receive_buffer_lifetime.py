"""The nccl receive path on CUDA: a received slice's device buffer (and the copy of its kept
blocks, `wire[keep]`, after a prefix-cache skip) is freed to the caching allocator once the
loader has queued its scatter on the loader's side stream; unless something holds it until that
stream has read it, the next allocation can overwrite it first. Made deterministic: the side
stream sleeps before each scatter, and the freed memory is filled with 0xFF."""

import time

import pytest
import torch

from decode_workers.kv_loader import KvLoader
from kv_transfer.integrity import slice_digest, transfer_epoch
from kv_transfer.metadata import Expected
from kv_transfer.transport import Inbox, LayerSlice
from tests.gpu.kv_caches import (
    BLOCK_TOKENS,
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    as_bits,
    layer_layout,
    random_bytes,
    vllm_caches,
)
from tests.gpu.transfer import DEADLINE_S

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("skip", [0, 1], ids=["no skip", "a prefix-cache skip"])
def test_received_blocks_outlive_their_scatter(device, skip):
    if device.type != "cuda":
        pytest.skip("CUDA only: on CPU the scatter happens at once")
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
        inbox.put(device_slice("race", layer, wires[layer], len(ids)))
        with torch.cuda.stream(loader.staging.stream):
            torch.cuda._sleep(100_000_000)  # the scatter queued next waits behind this
        loader.transfer_results([], set())
    del wires[: LAYERS - 1]  # the receiver's references: gone once the slice is released
    junk = [torch.empty_like(wires[0]).fill_(0xFF) for _ in range(2 * LAYERS)]  # next receives
    inbox.put(device_slice("race", LAYERS - 1, wires[0], len(ids)))
    deadline = time.monotonic() + DEADLINE_S
    while "req" not in loader.transfer_results([], set())[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    del junk
    torch.cuda.synchronize(device)
    canonical = [layout.canonical(c, HEAD_SIZE) for c in caches]
    overwritten = [
        layer
        for layer in range(LAYERS)
        if not torch.equal(as_bits(canonical[layer][ids[skip:]]), received[layer])
    ]
    assert not overwritten, f"layers {overwritten}: overwritten before their scatter read them"


def device_slice(transfer_id: str, layer: int, wire: torch.Tensor, blocks: int) -> LayerSlice:
    """A received slice as the nccl transport hands it over: a uint8 tensor on the device,
    with its integrity fields where the receiver checks them."""
    return LayerSlice(
        transfer_id,
        layer,
        0,
        blocks,
        0,
        KV_HEADS,
        wire,
        True,
        time.monotonic(),
        "nccl",
        epoch=transfer_epoch(transfer_id),
        seq=layer,
        digest=slice_digest(wire),
    )
