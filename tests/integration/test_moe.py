"""Mixture-of-experts models through P/D: the tiny random-weight Qwen3-MoE and Mixtral (8 experts,
top 2, served in bfloat16, the dtype they are saved in), whose greedy answers must equal vLLM's
offline engine's (TP 1, bfloat16) on the same weights wherever one engine size computes them
all. They are also the KV path's bfloat16 check: a disaggregated request's KV is 2 bytes an
element on the wire.

A TP-2 prefill's answer continued by a TP-1 decode worker is computed at two sizes, which no
single engine does: the prompt's KV comes from TP 2's sums (another order of additions than TP
1's), and these random-weight logits are near-tied. vLLM's own TP-1 and TP-2 engines parted on
them on a CPU without AMX (scripts/vllm_tp_agreement.py tiny-moe: 0 of 4 prompts agree); on one
with AMX they agree (4 of 4, 12 tokens), yet the pairing parted from the offline answer at the
ninth token of one prompt. There the check is the transfer's (every prompt token's KV arrived,
every byte counted); the merged heads' answers are checked where one size computes them,
tests/integration/test_tensor_parallel.py, and byte-exact across sizes in
tests/gpu/test_transfer_paths.py.

Four engines cover both shapes, TP 1 and 2, and every path, one model shape per cluster:
- Qwen3-MoE, a TP-2 prefill worker and a TP-1 decode worker: the disaggregated path (the
  decode worker merges the heads of two prefill ranks and computes no prompt token) and the
  local path at TP 1.
- Mixtral, two flex workers (one given the prefill role, one the decode role): the
  disaggregated path between them, the local path on a flex worker doing both, and the host KV
  pool they share: a long prompt the decode-role worker computed is loaded from the pool by the
  prefill-role worker, and answered the same.
Each cluster stops after its last test, so they never run side by side.
"""

import pytest

from kv_transfer.pool.client import store_stats
from kv_transfer.pool.wire import PoolStats
from tests.integration.conftest import (
    _stop_and_check,
    start_server,
    stopped_after_last_use,
    tiny_completion,
)
from tests.integration.processes import kv_pool_address, worker_pids
from tests.integration.prompts import TINY_LONG_PROMPT
from tests.integration.prompts import TINY_PROMPTS as PROMPTS
from tests.integration.references import MOE_MODELS
from tests.waiting import wait_for

QWEN, MIXTRAL = MOE_MODELS
DTYPE = "bfloat16"
# Both models' KV (pdserve/model_store/tiny_models.py): 2 layers, 2 KV heads of 64, in CPU
# blocks of 128 tokens, bfloat16 on the wire: 2 bytes an element.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, BFLOAT16_BYTES = 2, 2, 64, 128, 2
LONG_PROMPT_BLOCKS = 3  # full 128-token blocks of TINY_LONG_PROMPT (~500 tokens)


@pytest.fixture(scope="module")
def moe_reference(references) -> dict[str, list[dict]]:
    """vLLM's offline engine's greedy answers, per model: PROMPTS, then TINY_LONG_PROMPT."""
    outputs = references.answers("moe_reference")
    return {model: answers["prompts"] for model, answers in zip(MOE_MODELS, outputs, strict=True)}


def moe_cluster(tmp_path_factory, name: str, model: str, *more: str):
    """`pdserve serve` on tiny MoE `model`, stopped after the last test that uses fixture
    `name`."""
    server = start_server(
        tmp_path_factory.mktemp(name),
        "--model",
        model,
        "--dtype",
        DTYPE,
        "--kv-cache-gib",
        "0.25",
        *more,
    )
    with stopped_after_last_use(name, lambda: _stop_and_check(server)):
        yield server


@pytest.fixture(scope="session")
def qwen_tp2_to_tp1(tmp_path_factory):
    yield from moe_cluster(
        tmp_path_factory, "qwen_tp2_to_tp1", QWEN, "--prefill-tensor-parallel-size", "2"
    )


@pytest.fixture(scope="session")
def mixtral_flex(tmp_path_factory):
    yield from moe_cluster(
        tmp_path_factory, "mixtral_flex", MIXTRAL, "--flex", "2", "--kv-pool-gib", "0.25"
    )


ROUTES = ["disaggregated", "local"]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
@pytest.mark.parametrize("route", ROUTES)
def test_qwen3_moe_prefill_tp2_decode_tp1(qwen_tp2_to_tp1, moe_reference, route, index):
    """The local path (TP 1) equals the offline engine; the disaggregated one (two sizes) moves
    every prompt token's KV."""
    check_answer(qwen_tp2_to_tp1, QWEN, moe_reference, route, index, one_size=route == "local")


@pytest.mark.parametrize("index", range(len(PROMPTS)))
@pytest.mark.parametrize("route", ROUTES)
def test_mixtral_on_flex_workers_equals_offline(mixtral_flex, moe_reference, route, index):
    check_answer(mixtral_flex, MIXTRAL, moe_reference, route, index)


def check_answer(
    server, model: str, reference: dict, route: str, index: int, one_size: bool = True
) -> None:
    """PROMPTS[index] on `route` is answered (as the offline engine did, where `one_size`
    computes it all); on the disaggregated path every prompt token's KV arrived (the decode
    worker computed none), every head of every layer in bfloat16."""
    response = tiny_completion(server.url, PROMPTS[index], route, model)
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-route"] == route
    body = response.json()
    if one_size:
        expected = reference[model][index]
        assert len(set(expected["token_ids"])) > 1, "the reference repeats one token: a weak check"
        assert body["choices"][0]["text"] == expected["text"]
    if route == "disaggregated":
        tokens = body["usage"]["prompt_tokens"]
        assert int(response.headers["x-pdserve-decode-cached-tokens"]) == tokens
        per_block = 2 * KV_HEADS * BLOCK_SIZE * HEAD_SIZE * BFLOAT16_BYTES
        blocks = -(-tokens // BLOCK_SIZE)
        assert body["pdserve_timing"]["kv_bytes"] == LAYERS * blocks * per_block


def test_a_flex_worker_loads_from_the_pool_what_the_other_computed(mixtral_flex, moe_reference):
    """The decode-role worker computes the long prompt on the local path and stores its blocks
    in the host's pool; on the disaggregated path the prefill-role worker loads them from there
    (the store counts the hits) and both answers equal the offline engine's."""
    (address,) = {kv_pool_address(pid) for pid in worker_pids(mixtral_flex)}
    expected = moe_reference[MIXTRAL][len(PROMPTS)]["text"]
    local = tiny_completion(mixtral_flex.url, TINY_LONG_PROMPT, "local", MIXTRAL)
    assert local.status_code == 200, local.text
    assert local.json()["choices"][0]["text"] == expected
    wait_for(
        lambda: pool_stats(address).used >= LONG_PROMPT_BLOCKS, 30, "the prompt's blocks stored"
    )
    hits = pool_stats(address).hits
    disaggregated = tiny_completion(mixtral_flex.url, TINY_LONG_PROMPT, "disaggregated", MIXTRAL)
    assert disaggregated.status_code == 200, disaggregated.text
    assert disaggregated.headers["x-pdserve-prefill-worker"] != local.headers["x-pdserve-worker"]
    assert pool_stats(address).hits >= hits + LONG_PROMPT_BLOCKS
    assert disaggregated.json()["choices"][0]["text"] == expected


def pool_stats(address: str) -> PoolStats:
    stats = store_stats(address)
    assert stats is not None, f"the KV pool store at {address} did not answer"
    return stats
