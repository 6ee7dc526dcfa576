"""The staging and loading copies follow the forward stream: with it busy before it writes the
cache, the staged copy sees the write, and a load lands after a forward-stream write to the same
blocks."""

import pytest
import torch

from kv_transfer.host_staging import DeviceToHost, HostToDevice
from kv_transfer.kv_copy import gather, scatter
from tests.gpu.kv_caches import HEAD_SIZE, KV_HEADS, layer_layout, vllm_caches
from tests.gpu.transfer import SEND_BUFFER_BYTES

pytestmark = pytest.mark.gpu


def test_staging_and_loading_wait_for_the_forward_stream(device):
    if device.type != "cuda":
        pytest.skip("CUDA only: one stream on CPU")
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
    assert seen_write, "the staged copy ran before the forward stream's write"
    assert bool((canonical[ids] == 2.0).all()), "the load landed before the forward stream's write"
