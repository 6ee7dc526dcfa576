"""The KV path in bfloat16 on CPU, with the real engine: 1 prefill + 1 decode worker running
the tiny random-weight Llama in bfloat16. A disaggregated request must give the same greedy
tokens as the local path (the decode worker prefilling itself), computing no prompt token, and
its KV must be bfloat16 on the wire: 2 bytes an element."""

import pytest

from pdserve.model_store.store import ensure_model
from tests.integration.conftest import _stop_and_check, start_server, tiny_completion
from tests.integration.prompts import TINY_PROMPTS as PROMPTS

# The tiny model (pdserve/model_store/store.py): 2 layers, 2 KV heads of 64; CPU blocks of 128
# tokens.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 2, 64, 128
BFLOAT16_BYTES = 2


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    ensure_model("tiny")
    server = start_server(tmp_path_factory.mktemp("bf16"), "--model", "tiny", "--dtype", "bfloat16")
    yield server
    _stop_and_check(server)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_bfloat16_disaggregated_output_equals_local(tiny_bf16, index):
    disaggregated = tiny_completion(tiny_bf16.url, PROMPTS[index], "disaggregated")
    local = tiny_completion(tiny_bf16.url, PROMPTS[index], "local")
    assert disaggregated.status_code == local.status_code == 200, disaggregated.text
    body = disaggregated.json()
    tokens = body["usage"]["prompt_tokens"]
    assert body["choices"][0]["text"] == local.json()["choices"][0]["text"]
    assert int(disaggregated.headers["x-pdserve-decode-cached-tokens"]) == tokens
    blocks = -(-tokens // BLOCK_SIZE)
    per_block = 2 * KV_HEADS * BLOCK_SIZE * HEAD_SIZE * BFLOAT16_BYTES
    assert body["pdserve_timing"]["kv_bytes"] == LAYERS * blocks * per_block
