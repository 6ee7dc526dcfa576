"""Byte-exact transfers over every transport, in chunks that end mid-block, after a prefix-cache
skip, and between every prefill and decode tensor parallelism (both ways, replicated heads, an
MLA latent: one copy per decode rank, from one prefill rank)."""

from dataclasses import replace

import pytest
import torch

from tests.gpu.kv_caches import BLOCK_TOKENS, GQA, LAYERS, MLA
from tests.gpu.transfer import assert_exact, transfer

pytestmark = pytest.mark.gpu

# (total KV heads, prefill TP, decode TP): both ways, and 2 heads replicated over 4 ranks
TP_PAIRS = [
    (8, 1, 2),
    (8, 2, 1),
    (8, 1, 4),
    (8, 4, 1),
    (8, 2, 4),
    (8, 4, 2),
    (2, 1, 4),
    (2, 4, 1),
    (2, 2, 4),
    (2, 4, 2),
]


@pytest.mark.parametrize("transport", ["grpc", "shm", "nccl"])
def test_a_transfer_over_each_transport_is_byte_exact(device, transport, record_property):
    """nccl is gloo on the CPU; on CUDA it needs a second GPU for the decode rank."""
    decode_device = device
    if transport == "nccl" and device.type == "cuda":
        if torch.cuda.device_count() < 2:
            pytest.skip("NCCL needs a GPU per rank: one GPU here")
        decode_device = torch.device("cuda", (device.index or 0) + 1)
    (outcome,) = transfer(device, transport=transport, decode_device=decode_device)
    record_property("detail", assert_exact(outcome))


def test_chunked_prefill_ending_mid_block_sends_the_partial_block_again(device, record_property):
    """Chunks of 1.5 blocks: every step ends mid-block."""
    (outcome,) = transfer(
        device, prompt_tokens=5 * BLOCK_TOKENS + 3, chunk_tokens=BLOCK_TOKENS + BLOCK_TOKENS // 2
    )
    record_property("detail", assert_exact(outcome))


def test_a_prefix_cache_skip_leaves_the_decode_workers_own_blocks(device, record_property):
    (outcome,) = transfer(device, skip_blocks=2)
    record_property("detail", assert_exact(outcome))


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp"),
    TP_PAIRS,
    ids=[f"{h} KV heads, TP {p} to {d}" for h, p, d in TP_PAIRS],
)
def test_a_transfer_between_tensor_parallel_sizes_is_byte_exact(
    device, heads, prefill_tp, decode_tp, record_property
):
    (outcome,) = transfer(
        device, geometry=replace(GQA, heads=heads), prefill_tp=prefill_tp, decode_tp=decode_tp
    )
    record_property("detail", assert_exact(outcome))


MLA_TP_PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (4, 2)]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), MLA_TP_PAIRS, ids=[f"TP {p} to {d}" for p, d in MLA_TP_PAIRS]
)
def test_an_mla_latent_reaches_each_decode_rank_once_whatever_the_tensor_parallel_sizes(
    device, prefill_tp, decode_tp, record_property
):
    """Every rank holds the whole latent: each decode rank receives one copy (from one prefill
    rank), so the transfer moves decode_tp copies, never prefill_tp x decode_tp."""
    prompt_tokens = 5 * BLOCK_TOKENS
    (outcome,) = transfer(
        device,
        geometry=MLA,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        prompt_tokens=prompt_tokens,
    )
    detail = assert_exact(outcome)
    copy = LAYERS * prompt_tokens * MLA.head_size * 2  # bfloat16
    assert outcome.received == [copy] * decode_tp
    record_property(
        "detail",
        f"{detail}; {copy // prompt_tokens} B per token per decode rank, "
        f"{sum(outcome.received)} B in all (a copy per rank pair: {prefill_tp * decode_tp * copy})",
    )
