"""The plain-torch KV data plane in kv_transfer/: finding a layer's layout from its shape
(kv_layout), gathering a request's blocks into a wire tensor and scattering one back, through
raw bytes (kv_copy), routing KV heads between prefill and decode pools of different tensor
parallel sizes (head_shards), and the CPU path of host staging (host_staging).

The KV caches are small synthetic tensors laid out as vLLM lays them out: each is allocated in
its backend's memory order and handed over as a permuted view with the layout's logical
dimensions (vLLM 0.32's [block, head, token, K|V content] over HND, NHD or layer-interleaved
memory, and the older 5-dimensional FlashAttention and FlashInfer layouts). Sources hold a
distinct value in every element and destinations start as zeros, so any byte that lands in the
wrong place, or any block that is written but should not be, shows. Values are compared as raw
bytes (uint8 views), fp8 included. No vLLM, no CUDA, no network.
"""

import itertools
import re
from dataclasses import dataclass

import pytest
import torch

from kv_transfer.head_shards import check_shardable, head_routes, rank_heads
from kv_transfer.host_staging import DeviceToHost, HostToDevice
from kv_transfer.kv_copy import (
    as_bytes,
    first_of_run,
    from_bytes,
    gather,
    scatter,
    wire_shape,
    write_run,
)
from kv_transfer.kv_layout import (
    BLOCK,
    CONTENT,
    DIM,
    HEAD,
    KNOWN_LAYOUTS,
    KV,
    TOKEN,
    WIRE_ORDER,
    LayerLayout,
    LayoutError,
    find_layout,
    memory_order,
)

# Sizes chosen so that no two of them coincide (and none is 2, the size of the K/V pair), so
# each shape matches exactly one known layout.
NUM_BLOCKS = 7
NUM_HEADS = 4
BLOCK_SIZE = 3
HEAD_SIZE = 5
LAYER = "layer"  # only in the memory order of a layer-interleaved allocation
NUM_LAYERS = 3
THIS_LAYER = 1

# A request's blocks on the sending side and where the receiving side put them (all different).
SRC_IDS = [5, 1, 3]
DST_IDS = [0, 6, 2]

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8 = torch.float8_e4m3fn

V032 = (BLOCK, HEAD, TOKEN, CONTENT)


@dataclass(frozen=True)
class VllmCache:
    """One layer's cache as a vLLM backend hands it over: logical dims over a memory order."""

    name: str
    logical: tuple[str, ...]
    memory: tuple[str, ...]  # outermost first; LAYER when several layers share the allocation

    def build(self, dtype, fill, num_heads: int = NUM_HEADS):
        """(the whole allocation, this layer's cache view in the logical order)."""
        sizes = {
            BLOCK: NUM_BLOCKS,
            HEAD: num_heads,
            TOKEN: BLOCK_SIZE,
            KV: 2,
            DIM: HEAD_SIZE,
            CONTENT: 2 * HEAD_SIZE,
            LAYER: NUM_LAYERS,
        }
        alloc = fill(tuple(sizes[d] for d in self.memory), dtype)
        layer = alloc
        memory = self.memory
        if LAYER in memory:
            layer = alloc.select(memory.index(LAYER), THIS_LAYER)
            memory = tuple(d for d in memory if d != LAYER)
        return alloc, layer.permute(*(memory.index(d) for d in self.logical))

    def canonical(self, cache: torch.Tensor) -> torch.Tensor:
        return LayerLayout(self.logical).canonical(cache, HEAD_SIZE)


CPU_HND = VllmCache("0.32 CPU (HND)", V032, (BLOCK, HEAD, TOKEN, CONTENT))
FLASH_NHD = VllmCache("0.32 FlashAttention (NHD)", V032, (BLOCK, TOKEN, HEAD, CONTENT))
INTERLEAVED = VllmCache("0.32 layer-interleaved", V032, (BLOCK, LAYER, HEAD, TOKEN, CONTENT))


def in_logical_order(name: str, dims: tuple[str, ...]) -> VllmCache:
    """The layouts before vLLM 0.32 were allocated in their logical order."""
    return VllmCache(name, dims, dims)


OLD_FLASH = in_logical_order("FlashAttention before 0.32", (KV, BLOCK, TOKEN, HEAD, DIM))
OLD_FLASHINFER_HND = in_logical_order("FlashInfer HND before 0.32", (KV, BLOCK, HEAD, TOKEN, DIM))
OLD_FLASHINFER_NHD = in_logical_order("FlashInfer NHD before 0.32", (BLOCK, KV, TOKEN, HEAD, DIM))
OLD_BLOCK_HND = in_logical_order("block-first HND before 0.32", (BLOCK, KV, HEAD, TOKEN, DIM))
CACHES = [
    CPU_HND,
    FLASH_NHD,
    INTERLEAVED,
    OLD_FLASH,
    OLD_FLASHINFER_HND,
    OLD_FLASHINFER_NHD,
    OLD_BLOCK_HND,
]
CACHE_IDS = [c.name for c in CACHES]
CACHE_PAIRS = list(itertools.permutations(CACHES, 2))
CACHE_PAIR_IDS = [f"{a.name} -> {b.name}" for a, b in CACHE_PAIRS]

# One block of the wire tensor is [head, token, kv, dim]; how each layout holds the same block
# when indexed as vLLM indexes it (cache.select(block_dim, block)), written out by hand.
TO_LAYOUT_BLOCK = {
    V032: lambda w: w.reshape(w.shape[0], BLOCK_SIZE, 2 * HEAD_SIZE),  # K then V per row
    OLD_FLASH.logical: lambda w: w.permute(2, 1, 0, 3),  # kv, token, head, dim
    OLD_FLASHINFER_HND.logical: lambda w: w.permute(2, 0, 1, 3),  # kv, head, token, dim
    OLD_FLASHINFER_NHD.logical: lambda w: w.permute(2, 1, 0, 3),  # kv, token, head, dim
    OLD_BLOCK_HND.logical: lambda w: w.permute(2, 0, 1, 3),  # kv, head, token, dim
}


def distinct(shape, dtype) -> torch.Tensor:
    """A contiguous tensor whose elements all have different, finite, non-zero bit patterns
    (fp8 has too few of them: random values there, compared byte by byte all the same)."""
    n = 1
    for size in shape:
        n *= size
    if dtype == torch.float32:
        flat = torch.arange(1, n + 1, dtype=torch.float32)
    elif dtype.itemsize == 2:
        one = torch.tensor(1.0, dtype=dtype).view(torch.int16)  # consecutive values from 1.0
        flat = (one + torch.arange(n, dtype=torch.int16)).view(dtype)
        assert torch.isfinite(flat.float()).all()
    else:
        flat = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
    return flat.reshape(shape)


def zeros(shape, dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, in its logical order."""
    return tensor.contiguous().view(torch.uint8)


def all_zero(tensor: torch.Tensor) -> bool:
    return raw(tensor).count_nonzero().item() == 0


def untouched_blocks(written: list[int]) -> list[int]:
    return [b for b in range(NUM_BLOCKS) if b not in written]


def round_trip(wire: torch.Tensor) -> torch.Tensor:
    """The wire tensor as a receiver gets it: raw bytes, copied, read back into a tensor."""
    payload = bytes(as_bytes(wire))
    assert len(payload) == wire.numel() * wire.element_size()
    return from_bytes(bytearray(payload), wire.dtype, tuple(wire.shape))


# --- kv_layout: recognising a cache's layout -------------------------------------------------


def test_every_synthetic_cache_uses_a_known_layout_and_covers_all_of_them():
    assert {c.logical for c in CACHES} == set(KNOWN_LAYOUTS)


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, None], ids=["blocks given", "any blocks"])
@pytest.mark.parametrize("spec", CACHES, ids=CACHE_IDS)
def test_find_layout_recognises_each_vllm_layout_from_its_shape_and_the_model_sizes(
    spec, num_blocks
):
    _, cache = spec.build(torch.float32, zeros)
    layout = find_layout(cache.shape, num_blocks, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)
    assert layout == LayerLayout(spec.logical)
    assert layout.name == ",".join(spec.logical)
    assert cache.shape[layout.block_dim()] == NUM_BLOCKS


@pytest.mark.parametrize(
    "shape",
    [
        (NUM_BLOCKS, NUM_HEADS + 1, BLOCK_SIZE, 2 * HEAD_SIZE),  # wrong head count
        (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE),  # K only, no V
        (NUM_BLOCKS + 1, NUM_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE),  # wrong block count
        (3, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE),  # three of K/V
        (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2, HEAD_SIZE),  # the wire order is no cache layout
        (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE),
    ],
)
def test_find_layout_raises_a_layout_error_naming_a_shape_that_matches_no_layout(shape):
    with pytest.raises(LayoutError, match=re.escape(str(shape))):
        find_layout(shape, NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)


@pytest.mark.parametrize(
    "spec, expected",
    [
        (FLASH_NHD, "block,token,head,content"),
        (CPU_HND, "block,head,token,content"),
        (INTERLEAVED, "block,head,token,content"),
        (OLD_FLASH, "kv,block,token,head,dim"),
        (OLD_FLASHINFER_HND, "kv,block,head,token,dim"),
    ],
    ids=lambda v: v.name if isinstance(v, VllmCache) else None,
)
def test_memory_order_names_the_dimensions_outermost_first(spec, expected):
    _, cache = spec.build(torch.float32, zeros)
    assert memory_order(cache, LayerLayout(spec.logical)) == expected


@pytest.mark.parametrize("spec", CACHES, ids=CACHE_IDS)
def test_canonical_is_a_view_of_the_cache_in_wire_order_not_a_copy(spec):
    alloc, cache = spec.build(torch.float32, distinct)
    canonical = spec.canonical(cache)
    assert WIRE_ORDER == (BLOCK, HEAD, TOKEN, KV, DIM)
    assert canonical.shape == (NUM_BLOCKS, NUM_HEADS, BLOCK_SIZE, 2, HEAD_SIZE)
    assert canonical.data_ptr() == cache.data_ptr()
    assert canonical.untyped_storage().data_ptr() == alloc.untyped_storage().data_ptr()
    # Same elements: block 4 of the canonical view is block 4 of the cache, as vLLM indexes it.
    block = cache.select(LayerLayout(spec.logical).block_dim(), 4)
    assert torch.equal(TO_LAYOUT_BLOCK[spec.logical](canonical[4]), block)


# --- kv_copy: gather, bytes, scatter ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_spec, dst_spec", CACHE_PAIRS, ids=CACHE_PAIR_IDS)
def test_blocks_sent_as_bytes_arrive_byte_exact_in_a_differently_laid_out_cache(
    src_spec, dst_spec, dtype
):
    _, src_cache = src_spec.build(dtype, distinct)
    dst_alloc, dst_cache = dst_spec.build(dtype, zeros)
    src, dst = src_spec.canonical(src_cache), dst_spec.canonical(dst_cache)

    wire = gather(src, torch.tensor(SRC_IDS), slice(None))
    assert wire.shape == wire_shape(len(SRC_IDS), NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)
    assert wire.is_contiguous()
    scatter(round_trip(wire), dst, torch.tensor(DST_IDS), slice(None))

    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(raw(dst[d]), raw(src[s])), f"source block {s} -> block {d}"
    assert all_zero(dst[untouched_blocks(DST_IDS)])
    written = sum(raw(dst[d]).count_nonzero().item() for d in DST_IDS)
    assert raw(dst_alloc).count_nonzero().item() == written  # nothing else in the allocation


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CACHES, ids=[str(c) for c in CACHES])
def test_a_run_of_blocks_is_written_as_the_indexed_scatter_writes_it(spec, dtype):
    """write_run (consecutive blocks: a plain copy) leaves a cache exactly as scatter does, for
    this rank's heads only, in every layout."""
    _, src_cache = spec.build(dtype, distinct)
    wire = gather(spec.canonical(src_cache), torch.tensor(SRC_IDS), slice(0, 1))
    run = [4, 5, 6]
    assert first_of_run(run) == 4 and first_of_run(DST_IDS) is None
    assert first_of_run([3, 2]) is None and first_of_run([7]) == 7
    _, by_index = spec.build(dtype, zeros)
    _, by_run = spec.build(dtype, zeros)
    scatter(wire, spec.canonical(by_index), torch.tensor(run), slice(0, 1))
    write_run(wire, spec.canonical(by_run), 4, slice(0, 1))
    assert raw(by_run).count_nonzero().item() > 0
    assert torch.equal(raw(by_run), raw(by_index))


# Each layout sends to the next one in CACHES (a different layout, the last to the first).
NEXT_PAIRS = [(a, CACHES[(i + 1) % len(CACHES)]) for i, a in enumerate(CACHES)]
NEXT_PAIR_IDS = [f"{a.name} -> {b.name}" for a, b in NEXT_PAIRS]


def random_bytes(shape, dtype) -> torch.Tensor:
    """Any bit patterns at all: NaNs with payloads, infinities, negative zero, subnormals."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=generator)
    return data.to(torch.uint8).view(dtype)


@pytest.mark.parametrize("src_spec, dst_spec", NEXT_PAIRS, ids=NEXT_PAIR_IDS)
def test_fp8_blocks_sent_as_bytes_arrive_byte_exact_in_a_differently_laid_out_cache(
    src_spec, dst_spec
):
    _, src_cache = src_spec.build(FP8, distinct)
    _, dst_cache = dst_spec.build(FP8, zeros)
    src, dst = src_spec.canonical(src_cache), dst_spec.canonical(dst_cache)

    wire = gather(src, torch.tensor(SRC_IDS), slice(None))
    assert wire.dtype == FP8
    assert wire.shape == wire_shape(len(SRC_IDS), NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)
    scatter(round_trip(wire), dst, torch.tensor(DST_IDS), slice(None))

    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(raw(dst[d]), raw(src[s])), f"source block {s} -> block {d}"
    assert all_zero(dst[untouched_blocks(DST_IDS)])


@pytest.mark.parametrize("dtype", [*DTYPES, FP8], ids=str)
def test_every_bit_pattern_nan_payloads_included_survives_gather_and_scatter(dtype):
    _, src_cache = FLASH_NHD.build(dtype, random_bytes)
    _, dst_cache = OLD_FLASH.build(dtype, zeros)
    src, dst = FLASH_NHD.canonical(src_cache), OLD_FLASH.canonical(dst_cache)
    if dtype != FP8:  # the fill does hold NaNs, so a float copy could alter them
        assert torch.isnan(src.float()).any()

    wire = gather(src, torch.tensor(SRC_IDS), slice(None))
    scatter(round_trip(wire), dst, torch.tensor(DST_IDS), slice(None))

    for s, d in zip(SRC_IDS, DST_IDS, strict=True):
        assert torch.equal(raw(dst[d]), raw(src[s]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", CACHES, ids=CACHE_IDS)
def test_scatter_writes_into_the_original_cache_where_vllm_reads_each_block(spec, dtype):
    alloc, cache = spec.build(dtype, zeros)
    wire = distinct(wire_shape(len(DST_IDS), NUM_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype)
    scatter(wire, spec.canonical(cache), torch.tensor(DST_IDS), slice(None))

    block_dim = LayerLayout(spec.logical).block_dim()
    for i, d in enumerate(DST_IDS):
        expected = TO_LAYOUT_BLOCK[spec.logical](wire[i])
        assert torch.equal(raw(cache.select(block_dim, d)), raw(expected))
    for b in untouched_blocks(DST_IDS):
        assert all_zero(cache.select(block_dim, b))
    if LAYER in spec.memory:  # the other layers sharing the allocation are left alone
        for other in set(range(NUM_LAYERS)) - {THIS_LAYER}:
            assert all_zero(alloc.select(spec.memory.index(LAYER), other))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "src_spec, dst_spec", [(FLASH_NHD, CPU_HND), (OLD_FLASH, INTERLEAVED)], ids=str
)
def test_a_prefix_cache_hit_skips_the_first_block_and_leaves_it_untouched(
    src_spec, dst_spec, dtype
):
    _, src_cache = src_spec.build(dtype, distinct)
    _, dst_cache = dst_spec.build(dtype, zeros)
    src, dst = src_spec.canonical(src_cache), dst_spec.canonical(dst_cache)

    received = round_trip(gather(src, torch.tensor(SRC_IDS), slice(None)))
    scatter(received[1:], dst, torch.tensor(DST_IDS[1:]), slice(None))

    assert all_zero(dst[DST_IDS[0]])
    for s, d in zip(SRC_IDS[1:], DST_IDS[1:], strict=True):
        assert torch.equal(raw(dst[d]), raw(src[s]))
    assert all_zero(dst[untouched_blocks(DST_IDS)])


def test_as_bytes_and_from_bytes_share_memory_with_their_tensor_and_buffer():
    wire = distinct(wire_shape(2, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE), torch.bfloat16)
    view = as_bytes(wire)
    wire.reshape(-1).view(torch.uint8)[0] = 0xAB
    assert view[0] == 0xAB

    buffer = bytearray(bytes(view))
    tensor = from_bytes(buffer, torch.bfloat16, tuple(wire.shape))
    assert torch.equal(raw(tensor), raw(wire))
    buffer[1] ^= 0xFF
    assert tensor.reshape(-1).view(torch.uint8)[1].item() == buffer[1]


# --- head_shards: moving KV between tensor-parallel sizes ------------------------------------

TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2)]


@pytest.mark.parametrize("total_heads", [4, 2])
@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS, ids=str)
def test_head_routes_give_each_decode_rank_each_of_its_heads_exactly_once(
    total_heads, prefill_tp, decode_tp
):
    routes = head_routes(total_heads, prefill_tp, decode_tp)
    sent = [
        (route.decode_rank, head)
        for route in routes
        for head in range(route.first_head, route.first_head + route.num_heads)
    ]
    assert len(sent) == len(set(sent)), "a head sent twice to the same decode rank"
    needed = {
        (rank, head)
        for rank in range(decode_tp)
        for head in rank_heads(total_heads, decode_tp, rank)
    }
    assert set(sent) == needed
    for route in routes:  # a prefill rank only sends heads it holds
        held = rank_heads(total_heads, prefill_tp, route.prefill_rank)
        assert route.num_heads >= 1
        assert route.first_head in held and route.first_head + route.num_heads - 1 in held


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("total_heads", [4, 2])
@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS, ids=str)
def test_kv_moved_between_tp_sizes_lands_every_head_where_the_decode_rank_holds_it(
    total_heads, prefill_tp, decode_tp, dtype
):
    # The request's KV over all heads, in wire order; each prefill rank holds its shard.
    full = distinct((len(SRC_IDS), total_heads, BLOCK_SIZE, 2, HEAD_SIZE), dtype)
    prefill = []
    for rank in range(prefill_tp):
        heads = rank_heads(total_heads, prefill_tp, rank)
        _, cache = FLASH_NHD.build(dtype, zeros, num_heads=len(heads))
        canonical = FLASH_NHD.canonical(cache)
        canonical[torch.tensor(SRC_IDS)] = full[:, heads.start : heads.stop]
        assert not all_zero(cache)
        prefill.append(canonical)
    decode = []
    for rank in range(decode_tp):
        heads = rank_heads(total_heads, decode_tp, rank)
        _, cache = CPU_HND.build(dtype, zeros, num_heads=len(heads))
        decode.append(CPU_HND.canonical(cache))

    for route in head_routes(total_heads, prefill_tp, decode_tp):
        src_first = route.first_head - rank_heads(total_heads, prefill_tp, route.prefill_rank).start
        dst_first = route.first_head - rank_heads(total_heads, decode_tp, route.decode_rank).start
        wire = gather(
            prefill[route.prefill_rank],
            torch.tensor(SRC_IDS),
            slice(src_first, src_first + route.num_heads),
        )
        scatter(
            round_trip(wire),
            decode[route.decode_rank],
            torch.tensor(DST_IDS),
            slice(dst_first, dst_first + route.num_heads),
        )

    for rank, canonical in enumerate(decode):
        heads = rank_heads(total_heads, decode_tp, rank)
        assert torch.equal(raw(canonical[DST_IDS]), raw(full[:, heads.start : heads.stop]))
        assert all_zero(canonical[untouched_blocks(DST_IDS)])


@pytest.mark.parametrize("prefill_tp, decode_tp", TP_PAIRS, ids=str)
def test_an_mla_latent_goes_to_each_decode_rank_once_from_one_prefill_rank(prefill_tp, decode_tp):
    """An MLA latent is one head every rank holds: decode_tp routes, one per decode rank, each
    from one prefill rank, spread over them (a naive route would send prefill_tp x decode_tp)."""
    routes = head_routes(1, prefill_tp, decode_tp)
    assert [r.decode_rank for r in routes] == list(range(decode_tp))
    assert all((r.first_head, r.num_heads) == (0, 1) for r in routes)
    sources = [r.prefill_rank for r in routes]
    assert len(set(sources)) == min(prefill_tp, decode_tp)  # spread over the prefill ranks


@pytest.mark.parametrize("rank", range(4))
def test_with_fewer_heads_than_ranks_each_head_is_replicated_on_consecutive_ranks(rank):
    assert rank_heads(2, 4, rank) == range(rank // 2, rank // 2 + 1)


@pytest.mark.parametrize("tp, rank, expected", [(1, 0, range(0, 4)), (2, 1, range(2, 4))])
def test_with_at_least_as_many_heads_as_ranks_each_rank_holds_an_even_slice(tp, rank, expected):
    assert rank_heads(4, tp, rank) == expected


@pytest.mark.parametrize("total_heads, tp", [(4, 3), (2, 3), (4, 0)])
def test_check_shardable_rejects_a_tp_size_vllm_cannot_shard_the_heads_over(total_heads, tp):
    with pytest.raises(ValueError, match=f"{total_heads} KV heads"):
        check_shardable(total_heads, tp)
    with pytest.raises(ValueError):
        head_routes(total_heads, tp, 1)


@pytest.mark.parametrize("total_heads, tp", [(4, 1), (4, 2), (4, 4), (2, 4), (2, 8)])
def test_check_shardable_accepts_tp_sizes_that_divide_or_are_divided_by_the_heads(total_heads, tp):
    check_shardable(total_heads, tp)


# --- host_staging: the CPU path -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, FP8], ids=str)
def test_device_to_host_on_cpu_hands_over_the_gathered_tensors_own_bytes(dtype):
    _, cache = FLASH_NHD.build(dtype, distinct)
    canonical = FLASH_NHD.canonical(cache)
    gathered = []  # what gather() returned, each time it ran

    def gather_once() -> torch.Tensor:
        gathered.append(gather(canonical, torch.tensor(SRC_IDS), slice(None)))
        return gathered[-1]

    staging = DeviceToHost(CPU, 1 << 20)
    staged = staging.stage(gather_once)
    host = staged.ready()
    assert len(gathered) == 1
    wire = gathered[0]
    assert host.dtype == torch.uint8
    assert host.data_ptr() == wire.data_ptr()  # no copy
    assert host.numel() == wire.numel() * wire.element_size()
    assert torch.equal(host, raw(wire).reshape(-1))
    for i, s in enumerate(SRC_IDS):
        assert torch.equal(raw(wire[i]), raw(canonical[s]))

    before = host.clone()
    staged.release()
    staged.release()
    staging.fence()
    assert torch.equal(staged.ready(), before)


def test_host_to_device_on_cpu_calls_write_at_once_with_the_same_tensors():
    wire = distinct(wire_shape(2, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE), torch.float32)
    index = torch.tensor([4, 0])
    writes = []
    loader = HostToDevice(CPU)
    loader.load(wire, index, lambda w, i: writes.append((w, i)))
    assert len(writes) == 1
    assert writes[0][0] is wire and writes[0][1] is index
    assert loader.wait() is None
    assert len(writes) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_to_device_on_cpu_has_scattered_into_the_cache_before_wait(dtype):
    _, cache = INTERLEAVED.build(dtype, zeros)
    canonical = INTERLEAVED.canonical(cache)
    wire = distinct(wire_shape(len(DST_IDS), NUM_HEADS, BLOCK_SIZE, HEAD_SIZE), dtype)
    loader = HostToDevice(CPU)
    loader.load(wire, torch.tensor(DST_IDS), lambda w, i: scatter(w, canonical, i, slice(None)))
    for i, d in enumerate(DST_IDS):
        assert torch.equal(raw(canonical[d]), raw(wire[i]))
    loader.wait()
    assert all_zero(canonical[untouched_blocks(DST_IDS)])
