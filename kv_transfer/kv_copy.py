"""Gather a request's blocks of one layer into a contiguous wire tensor, and scatter one into a
layer's cache: plain torch, any dtype (fp8 included: bytes are read through a uint8 view, never
numpy), any device, any layout (through `LayerLayout.canonical`).

A wire tensor is [blocks, heads, block_size, kv_size, head_size], contiguous (kv_size 2: K and
V; 1: an MLA latent); `heads` selects the range of this rank's heads being sent (all of them
when both pools run at the same TP).
"""

import ctypes

import torch

# Copies move bits: an integer view of the same width works for every dtype (index_copy_ has no
# fp8 kernel, and no float kernel can change a NaN's payload).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gather(canonical_cache: torch.Tensor, block_ids: torch.Tensor, heads: slice) -> torch.Tensor:
    """The blocks `block_ids` (a long tensor on the cache's device) of heads `heads`, as one new
    contiguous tensor on the cache's device, in the cache's dtype."""
    bits = _BITS[canonical_cache.element_size()]
    return (
        canonical_cache[:, heads].view(bits).index_select(0, block_ids).view(canonical_cache.dtype)
    )


def scatter(
    wire: torch.Tensor, canonical_cache: torch.Tensor, block_ids: torch.Tensor, heads: slice
) -> None:
    """Write `wire` (same device and dtype as the cache) into blocks `block_ids`, heads
    `heads` of the cache (through the view, into the cache's own memory)."""
    bits = _BITS[canonical_cache.element_size()]
    canonical_cache[:, heads].view(bits).index_copy_(0, block_ids, wire.view(bits))


def write_run(
    wire: torch.Tensor, canonical_cache: torch.Tensor, first_block: int, heads: slice
) -> None:
    """`scatter` into the consecutive blocks from `first_block` on (how vLLM mostly hands out a
    fresh request's blocks): a plain strided copy, about twice as fast as the indexed one on a
    CPU, and no index to bring to the device."""
    bits = _BITS[canonical_cache.element_size()]
    blocks = canonical_cache[first_block : first_block + wire.shape[0], heads]
    blocks.view(bits).copy_(wire.view(bits))


def first_of_run(block_ids: list[int]) -> int | None:
    """The first of `block_ids` where they are consecutive and ascending, else None."""
    first = block_ids[0]
    return first if block_ids == list(range(first, first + len(block_ids))) else None


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor of any dtype, without a copy (through ctypes,
    not numpy: a torch-only machine has no numpy). The view keeps the tensor alive."""
    flat = tensor.reshape(-1).view(torch.uint8)
    memory = (ctypes.c_uint8 * flat.numel()).from_address(flat.data_ptr())
    memory.tensor = flat  # the memory's owner lives as long as the view
    return memoryview(memory).cast("B")


def from_bytes(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `data` without a copy: a writable buffer (bytearray) gives a CPU tensor,
    a flat uint8 tensor (received on the device) stays where it is."""
    if not isinstance(data, torch.Tensor):
        data = torch.frombuffer(data, dtype=torch.uint8)
    return data.view(dtype).view(shape)


def wire_shape(
    num_blocks: int, num_heads: int, block_size: int, head_size: int, kv_size: int = 2
) -> tuple[int, ...]:
    return (num_blocks, num_heads, block_size, kv_size, head_size)
