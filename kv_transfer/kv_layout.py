"""Where the blocks, heads, tokens and K/V of one layer's KV cache are, in plain torch.

vLLM hands a connector each layer's cache as a tensor whose dimension order and memory order
depend on the attention backend and vLLM version: vLLM 0.32 gives every backend the logical
view [blocks, kv_heads, block_size, 2*head_size] (K then V in the last dimension) over memory
in the backend's own order (HND on CPU, NHD for FlashAttention, layer-interleaved for some), and
older FlashAttention caches are [2, blocks, block_size, kv_heads, head_size]. A `LayerLayout`
names each dimension, found by matching the tensor's shape against the sizes the model gives;
`canonical(cache)` is then a view (never a copy) in the wire order:

    WIRE_ORDER = [block, head, token, kv, dim]

so a request's KV travels in one order whatever either side's layout is, and two workers with
different cache layouts still exchange it. The kv dimension is 2 (K, V) for per-head caches and
1 for multi-head latent attention (MLA): vLLM 0.32 keeps one latent per token (kv_lora_rank +
rope dim: 576 values for DeepSeek), no V, in the same view with one "head",
[blocks, 1, block_size, latent]: that view with `kv_size` 1.
"""

from dataclasses import dataclass

import torch

BLOCK, HEAD, TOKEN, KV, DIM, CONTENT = "block", "head", "token", "kv", "dim", "content"
WIRE_ORDER = (BLOCK, HEAD, TOKEN, KV, DIM)
WIRE_LAYOUT = ",".join(WIRE_ORDER)  # what the compatibility handshake compares

# Layer views vLLM backends have used, most recent first ("content" is kv and dim fused, K first).
KNOWN_LAYOUTS = (
    (BLOCK, HEAD, TOKEN, CONTENT),  # vLLM 0.32, every backend (logical view)
    (KV, BLOCK, TOKEN, HEAD, DIM),  # FlashAttention before 0.32 (NHD)
    (KV, BLOCK, HEAD, TOKEN, DIM),  # FlashInfer HND before 0.32
    (BLOCK, KV, TOKEN, HEAD, DIM),  # FlashInfer NHD before 0.32
    (BLOCK, KV, HEAD, TOKEN, DIM),
)


class LayoutError(ValueError):
    """A cache tensor matches none of the known layer layouts."""


@dataclass(frozen=True)
class LayerLayout:
    dims: tuple[str, ...]  # the name of each dimension of the cache tensor, in order
    kv_size: int = 2  # K and V per head-token; 1: an MLA latent

    @property
    def name(self) -> str:
        return ",".join(self.dims)

    def block_dim(self) -> int:
        return self.dims.index(BLOCK)

    def canonical(self, cache: torch.Tensor, head_size: int) -> torch.Tensor:
        """A view of `cache` as [blocks, heads, block_size, kv_size, head_size] (no copy)."""
        dims = self.dims
        if CONTENT in dims:
            at = dims.index(CONTENT)
            cache = cache.unflatten(at, (self.kv_size, head_size))
            dims = dims[:at] + (KV, DIM) + dims[at + 1 :]
        return cache.permute(*(dims.index(name) for name in WIRE_ORDER))


def find_layout(
    shape: tuple[int, ...],
    num_blocks: int | None,
    num_heads: int,
    block_size: int,
    head_size: int,
    kv_size: int = 2,
) -> LayerLayout:
    """The first known layout whose sizes match `shape` (`num_blocks` None: any; `kv_size` 1:
    an MLA latent of `head_size` values). Sizes that coincide (2 heads and the K/V pair, say)
    are resolved by the order of KNOWN_LAYOUTS."""
    sizes = {
        BLOCK: num_blocks,
        HEAD: num_heads,
        TOKEN: block_size,
        KV: kv_size,
        DIM: head_size,
        CONTENT: kv_size * head_size,
    }
    for dims in KNOWN_LAYOUTS:
        if len(dims) == len(shape) and all(
            size == sizes[d] or (d == BLOCK and num_blocks is None)
            for d, size in zip(dims, shape, strict=True)
        ):
            return LayerLayout(dims, kv_size)
    what = "an MLA latent" if kv_size == 1 else "K and V"
    raise LayoutError(
        f"a KV cache of shape {tuple(shape)} matches no known layout for {num_blocks} blocks, "
        f"{num_heads} KV heads, block size {block_size}, head size {head_size} ({what})"
    )


def memory_order(cache: torch.Tensor, layout: LayerLayout) -> str:
    """The dimensions from outermost to innermost in memory, e.g. "block,token,head,content"
    for FlashAttention's NHD (logged beside the handshake; it need not match across workers)."""
    order = sorted(range(cache.dim()), key=lambda d: -cache.stride(d))
    return ",".join(layout.dims[d] for d in order)
