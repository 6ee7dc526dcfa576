"""Multi-head latent attention through P/D with the real engine: the tiny DeepSeek-V2 (MLA latent
512 + 64 = 576 values a token, MoE; bfloat16; vLLM's CPU MLA backends: the reference one's blocks
of 16 tokens, no prefix caching, no chunked prefill, or where the CPU has AMX tiles the AMX one's
blocks of 128 tokens, with prefix caching) on every pairing of tensor-parallel sizes: prefill
TP=2 -> decode TP=1, TP=1 -> TP=2, TP=1 -> TP=1 and TP=2 -> TP=2. In each the decode worker computes
no prompt token and the KV moved is one latent copy per decode rank (from one prefill rank),
never one per (prefill rank, decode rank) pair.

Greedy answers are compared where one engine's numbers exist to compare with: TP=1 -> TP=1
equals the TP=1 decode worker's own answer, TP=2 -> TP=2 the TP=2 decode worker's (the prompt
computed there alone, on the local path: vLLM's engine, no KV moved). A random-weight model in
bfloat16 has near-tied logits at every step, and vLLM's TP=1 and TP=2 engines round differently
(their greedy answers to these prompts part within two tokens, their first-step logprobs by up
to 1 nat; so do one prompt alone and in a batch): a pairing of two sizes computes the prompt at
one and the answer at the other, which no single engine does. There a slice missing, doubled or
damaged on any rank fails the transfer (counted bytes, no prompt token computed, digests); the
byte-exact routes between sizes are tests/gpu/test_transfer_paths.py's.

Two clusters give the four engines: A has a TP=2 prefill and a TP=1 decode worker, B a TP=1
prefill and a TP=2 decode worker; routers over A's prefill and B's decode (TP 2 -> 2), and B's
prefill and A's decode (TP 1 -> 1), make the other pairings. Each pairing sends its own prompt.
The host KV pool of B stores what its TP=2 decode worker computes once (rank 0 writes one copy:
its slots are one rank's block) and, without prefix caching, loads it into both ranks for the
next request, which goes on with the same tokens."""

import pytest
import torch

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.wire import GetStats
from pdserve.model_store.store import ensure_model
from tests.integration.conftest import (
    _stop_and_check,
    router_over,
    start_server,
    tiny_completion,
)
from tests.integration.http_client import HTTP
from tests.integration.processes import kv_pool_address, worker_pids
from tests.integration.prompts import TINY_MAX_TOKENS
from tests.waiting import wait_for

MODEL = "tiny-mla"
# vLLM's CPU platform (vllm/platforms/cpu.py) runs MLA on its AMX kernels where the CPU has AMX
# tiles, in 128-token blocks with prefix caching; elsewhere on its reference kernels, in 16-token
# blocks without.
AMX_MLA = torch.cpu._is_amx_tile_supported()
LAYERS, LATENT, BLOCK_TOKENS, BF16_BYTES = 2, 576, 128 if AMX_MLA else 16, 2
PAIRINGS = {  # name -> (prefill TP, decode TP), each with its own prompt (a block or more)
    "TP 2 to 1": (2, 1),
    "TP 1 to 2": (1, 2),
    "TP 1 to 1": (1, 1),
    "TP 2 to 2": (2, 2),
}
TEXTS = {  # each 16 tokens or more
    "TP 2 to 1": (
        "The capital of France is Paris, the capital of Germany is Berlin, and the capital"
    ),
    "TP 1 to 2": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "TP 1 to 1": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    # Its first token is a whole word: one without text yet (a character's first bytes) is
    # sampled again by the decode worker, on MLA's decode kernels, which round differently.
    "TP 2 to 2": (
        "A second prompt talks about oceans, islands and the small boats that sail between them"
    ),
}
# A block or more each: a text repeated BLOCK_TOKENS // 16 times.
PROMPTS = {name: " ".join([text] * (BLOCK_TOKENS // 16)) for name, text in TEXTS.items()}
POOL_TEXT = (  # 32 tokens, repeated into a prompt of two full blocks, which the pool stores
    "A long time ago in a galaxy far, far away, the rebels hid on an ice planet while the "
    "empire searched every system for them with probe droids sent"
)


def mla_cluster(tmp_path_factory, prefill_tp: int, decode_tp: int):
    ensure_model(MODEL)
    return start_server(
        tmp_path_factory.mktemp(f"mla-tp{prefill_tp}to{decode_tp}"),
        "--model",
        MODEL,
        "--dtype",
        "bfloat16",
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--tensor-parallel-size",
        str(decode_tp),
    )


@pytest.fixture(scope="module")
def cluster_a(tmp_path_factory):
    server = mla_cluster(tmp_path_factory, 2, 1)
    yield server
    _stop_and_check(server)


@pytest.fixture(scope="module")
def cluster_b(tmp_path_factory):
    server = mla_cluster(tmp_path_factory, 1, 2)
    yield server
    _stop_and_check(server)


@pytest.fixture(scope="module")
def routers(cluster_a, cluster_b, tmp_path_factory) -> dict[str, str]:
    """Each pairing's router URL: the clusters' own, and two over one worker of each."""
    address = {
        (name, row["role"]): row["address"]
        for name, server in (("a", cluster_a), ("b", cluster_b))
        for row in server.workers()
    }
    folder = tmp_path_factory.mktemp("mla-routers")
    settings = {"model": MODEL, "served_model_name": MODEL}
    with (
        router_over(
            [address["b", "prefill"], address["a", "decode"]], folder / "tp1", **settings
        ) as tp1,
        router_over(
            [address["a", "prefill"], address["b", "decode"]], folder / "tp2", **settings
        ) as tp2,
    ):
        yield {
            "TP 2 to 1": cluster_a.url,
            "TP 1 to 2": cluster_b.url,
            "TP 1 to 1": tp1,
            "TP 2 to 2": tp2,
        }


def reference_text(pairing: str, request) -> str | None:
    """What the pairing's answer must equal, where one engine computes it all (None: none)."""
    # The decode worker of the pairing's size computes the prompt itself (A's is TP=1, B's TP=2),
    # under a cache salt: the blocks it caches (with AMX) must not serve the disaggregated request.
    cluster = {"TP 1 to 1": "cluster_a", "TP 2 to 2": "cluster_b"}.get(pairing)
    if cluster is None:
        return None
    url = request.getfixturevalue(cluster).url
    local = local_completion(url, PROMPTS[pairing], cache_salt="the local reference")
    assert len(set(local["token_ids"])) > 1, "the reference repeats one token"
    return local["text"]


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_mla_pd_moves_one_latent_copy_per_decode_rank_and_answers_as_one_engine(
    request, routers, pairing
):
    expected = reference_text(pairing, request)
    prompt = PROMPTS[pairing]
    response = tiny_completion(routers[pairing], prompt, "disaggregated", MODEL)
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-route"] == "disaggregated"
    body = response.json()
    tokens = body["usage"]["prompt_tokens"]
    assert tokens >= BLOCK_TOKENS  # a full block at least
    assert int(response.headers["x-pdserve-decode-cached-tokens"]) == tokens
    prefill_tp, decode_tp = PAIRINGS[pairing]
    blocks = -(-tokens // BLOCK_TOKENS)
    copy = LAYERS * blocks * BLOCK_TOKENS * LATENT * BF16_BYTES  # one rank's latent, all layers
    moved = body["pdserve_timing"]["kv_bytes"]
    assert moved == decode_tp * copy
    print(
        f"MLA {pairing}: {moved} B moved for {tokens} prompt tokens ({blocks} blocks), "
        f"{moved // (blocks * BLOCK_TOKENS)} B per token; a copy per (prefill, decode) rank pair "
        f"would be {prefill_tp * decode_tp * copy} B"
    )
    if expected is not None:
        assert body["choices"][0]["text"] == expected


def local_completion(url: str, prompt, max_tokens: int = TINY_MAX_TOKENS, **fields) -> dict:
    """A greedy completion's choice on the local path, with its prompt's and answer's token ids
    (`fields`: more of the request's)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = HTTP.post(
        f"{url}/v1/completions",
        timeout=120,
        headers={"x-pdserve-route": "local"},
        json={**body, "return_token_ids": True, **fields},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def pool_prompt(url: str) -> list[int]:
    """POOL_TEXT's token ids, repeated to exactly two blocks."""
    reply = HTTP.post(f"{url}/tokenize", timeout=30, json={"model": MODEL, "prompt": POOL_TEXT})
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    return (tokens * (2 * BLOCK_TOKENS // len(tokens) + 1))[: 2 * BLOCK_TOKENS]


def test_the_pool_stores_an_mla_latent_once_and_loads_it_into_every_rank(cluster_b):
    """The TP=2 decode worker answers a prompt of two full blocks (local path): rank 0 stores
    their latent once (a slot is one rank's block). Then asked to go on from the prompt and the
    answer's first token, its engine loads both blocks (from the pool into both ranks, where
    vLLM keeps no prefix cache for MLA; from its own cache with AMX) and computes that token's
    position alone, as it did answering: the rest of the answer must be the same tokens (a rank
    loading a wrong latent would change them)."""
    (address,) = {kv_pool_address(pid) for pid in worker_pids(cluster_b, "decode")}
    store = PoolClient(address, namespace=None)
    used = store.call(GetStats()).used
    first = local_completion(cluster_b.url, pool_prompt(cluster_b.url), TINY_MAX_TOKENS)
    prompt, answer = first["prompt_token_ids"], first["token_ids"]
    assert len(prompt) == 2 * BLOCK_TOKENS and len(set(answer)) > 1
    wait_for(lambda: store.call(GetStats()).used >= used + 2, 30, "the prompt in the pool")
    stats = store.call(GetStats())
    assert stats.slot_bytes == LAYERS * BLOCK_TOKENS * LATENT * BF16_BYTES  # one copy a block
    going_on = local_completion(cluster_b.url, [*prompt, answer[0]], TINY_MAX_TOKENS - 1)
    assert store.call(GetStats()).hits == stats.hits + (0 if AMX_MLA else 2)
    assert going_on["token_ids"] == answer[1:]
