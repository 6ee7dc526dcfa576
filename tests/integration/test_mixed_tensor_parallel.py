"""Prefill and decode pools at different tensor-parallel sizes, on CPU, with the tiny
random-weight Llama (4 heads, 2 KV heads): prefill TP=2 -> decode TP=1 (each decode rank merges
the heads of two prefill ranks) and prefill TP=1 -> decode TP=2 (the prefill rank splits its
heads over two decode ranks). Greedy output must equal vLLM's offline engine at TP=1, and the
decode worker must have computed no prompt token: every head of every layer arrived."""

import pytest

from pdserve.model_store.store import ensure_model
from tests.integration.conftest import _stop_and_check, start_server, tiny_completion
from tests.integration.prompts import TINY_PROMPTS as PROMPTS


@pytest.fixture(
    scope="module", params=[(2, 1), (1, 2)], ids=["prefill2-decode1", "prefill1-decode2"]
)
def tiny_mixed_tp(request, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    ensure_model("tiny")
    server = start_server(
        tmp_path_factory.mktemp(f"tp{prefill_tp}to{decode_tp}"),
        "--model",
        "tiny",
        "--prefill-tensor-parallel-size",
        str(prefill_tp),
        "--tensor-parallel-size",
        str(decode_tp),
    )
    yield server
    _stop_and_check(server)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_mixed_tp_disaggregated_output_equals_tp1_offline(tiny_mixed_tp, tiny_reference, index):
    response = tiny_completion(tiny_mixed_tp, PROMPTS[index], "disaggregated")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == tiny_reference["prompts"][index]["text"]
    assert int(response.headers["x-pdserve-decode-cached-tokens"]) == body["usage"]["prompt_tokens"]
    assert body["pdserve_timing"]["kv_bytes"] > 0
