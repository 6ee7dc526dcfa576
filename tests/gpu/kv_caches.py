"""KV caches as vLLM 0.32 allocates them on a device, and the byte views the checks compare."""

from dataclasses import dataclass

import torch

from kv_transfer.kv_layout import LayerLayout, find_layout

LAYERS, BLOCKS, BLOCK_TOKENS, HEAD_SIZE = 3, 48, 16, 128  # a Llama-8B-like layer shard
KV_HEADS = 8


@dataclass(frozen=True)
class Geometry:
    """One token's KV in a layer: `heads` KV heads over all ranks, each `kv_size` x
    `head_size` values."""

    heads: int
    head_size: int
    kv_size: int


GQA = Geometry(KV_HEADS, HEAD_SIZE, 2)  # K and V per head, the heads sharded over TP
MLA = Geometry(1, 576, 1)  # DeepSeek's latent (kv_lora_rank 512 + rope 64), on every rank
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


def vllm_caches(
    layout: str, heads: int, dtype: torch.dtype, device, geometry: Geometry = GQA
) -> list[torch.Tensor]:
    """One layer group's caches (`heads` of them on this rank), as vLLM 0.32's
    create_kv_cache_views makes them: an int8 buffer, strided by the layout's order over
    [L, B, H, N, C bytes], one view per layer."""
    width = torch.empty(0, dtype=dtype).element_size()
    content = geometry.kv_size * geometry.head_size * width
    if layout in OLD_LAYOUTS:
        size = {
            "kv": geometry.kv_size,
            "block": BLOCKS,
            "token": BLOCK_TOKENS,
            "head": heads,
            "dim": geometry.head_size,
        }
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
    """Random bytes viewed as `dtype` (bfloat16 and fp8 have no random integers of their own)."""
    width = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, device=device)
    return raw.view(dtype)


def layer_layout(cache: torch.Tensor, heads: int, geometry: Geometry = GQA) -> LayerLayout:
    return find_layout(
        tuple(cache.shape), BLOCKS, heads, BLOCK_TOKENS, geometry.head_size, geometry.kv_size
    )


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of any tensor (a copy on the host), for byte-exact comparisons."""
    return tensor.contiguous().view(torch.uint8).cpu()
