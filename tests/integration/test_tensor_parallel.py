"""Tensor parallelism on CPU: 1 prefill + 1 decode worker at tensor_parallel_size=2 (vLLM's
multiprocessing executor; its CPU backend has no Ray executor) with the tiny random-weight
Llama (4 heads, 2 KV heads). Rank r of the prefill worker sends its KV heads to rank r of the
decode worker. Greedy output must equal vLLM's offline engine at TP=1 on the same weights."""

import pytest

from pdserve.model_store.store import ensure_model
from tests.integration.conftest import _stop_and_check, start_server, tiny_completion
from tests.integration.prompts import TINY_PROMPTS as PROMPTS


@pytest.fixture(scope="module")
def tiny_tp2(tmp_path_factory):
    ensure_model("tiny")
    server = start_server(
        tmp_path_factory.mktemp("tp2"), "--model", "tiny", "--tensor-parallel-size", "2"
    )
    yield server
    _stop_and_check(server)


@pytest.mark.parametrize("route", ["local", "disaggregated"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_tp2_output_equals_tp1_offline(tiny_tp2, tiny_reference, route, index):
    response = tiny_completion(tiny_tp2, PROMPTS[index], route)
    assert response.status_code == 200, response.text
    assert response.headers["x-pdserve-route"] == route
    body = response.json()
    expected = tiny_reference["prompts"][index]
    assert len(set(expected["token_ids"])) > 1, "the reference repeats one token: a weak check"
    assert body["choices"][0]["text"] == expected["text"]
    if route == "disaggregated":  # both ranks' KV arrived: the decode worker computed no prompt
        assert (
            int(response.headers["x-pdserve-decode-cached-tokens"])
            == body["usage"]["prompt_tokens"]
        )
