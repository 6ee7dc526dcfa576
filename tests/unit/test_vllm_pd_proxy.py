"""scripts/vllm_pd_proxy.py, vLLM's toy P/D proxy protocol as compare_vllm.py's vllm-nixl system
speaks it: the request each server gets, and what goes back to the client (a stream relayed as
it comes, an upstream error with its own status, a missing kv_transfer_params as an error). The
two vLLM servers are fakes (an httpx MockTransport); the real ones run in compare_vllm.py."""

import asyncio
import importlib.util
import json
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"remote_block_ids": [[3, 4]], "remote_engine_id": "p-0", "remote_request_id": "r-1"}
CLIENT_BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def proxy_module():
    path = ROOT / "scripts" / "vllm_pd_proxy.py"
    spec = importlib.util.spec_from_file_location("vllm_pd_proxy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_body_asks_for_one_token_and_a_remote_decode(proxy_module):
    body = CLIENT_BODY | {"max_completion_tokens": 64}
    prefill = proxy_module.prefill_body(body)
    assert prefill["max_tokens"] == 1 and prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert prefill["prompt"] == "hello" and prefill["ignore_eos"] is True
    assert body == CLIENT_BODY | {"max_completion_tokens": 64}  # the client's body untouched
    assert "max_completion_tokens" not in proxy_module.prefill_body(CLIENT_BODY)


def test_decode_body_is_the_request_as_sent_with_the_prefill_params(proxy_module):
    decode = proxy_module.decode_body(CLIENT_BODY, {"kv_transfer_params": PARAMS})
    assert decode == CLIENT_BODY | {"kv_transfer_params": PARAMS}
    with pytest.raises(proxy_module.UpstreamError) as caught:
        proxy_module.decode_body(CLIENT_BODY, {"choices": []})
    assert caught.value.status_code == 502


class FakeServers:
    """Stands in for the prefill and the decode server: records each body; the prefill server
    answers `prefill_status` (and its params unless `no_params`), the decode server streams
    a chunk and [DONE]."""

    def __init__(self, prefill_status: int = 200, no_params: bool = False):
        self.prefill_status, self.no_params = prefill_status, no_params
        self.bodies: dict[str, dict] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.port == 1 else "decode"
        self.bodies[role] = json.loads(request.content)
        if role == "prefill":
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "busy"}})
            reply = {} if self.no_params else {"kv_transfer_params": PARAMS}
            return httpx.Response(200, json=reply)
        return httpx.Response(200, content=sse(), headers={"content-type": "text/event-stream"})


async def sse():
    yield b'data: {"choices":[{"text":"a"}]}\n\n'
    yield b"data: [DONE]\n\n"


def post(proxy_module, servers: FakeServers, body: dict) -> httpx.Response:
    proxy = proxy_module.Proxy("http://upstream:1", "http://upstream:2", timeout_s=5)
    proxy.http = httpx.AsyncClient(transport=httpx.MockTransport(servers))

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=proxy_module.app(proxy))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/completions", json=body, timeout=5)

    return asyncio.run(go())


def test_a_stream_goes_to_decode_with_the_params_and_comes_back(proxy_module):
    servers = FakeServers()
    response = post(proxy_module, servers, CLIENT_BODY)
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n") and '"text":"a"' in response.text
    assert servers.bodies["prefill"]["max_tokens"] == 1
    assert servers.bodies["decode"] == CLIENT_BODY | {"kv_transfer_params": PARAMS}


def test_upstream_errors_keep_their_status(proxy_module):
    servers = FakeServers(prefill_status=429)
    response = post(proxy_module, servers, CLIENT_BODY)
    assert response.status_code == 429 and response.json()["error"]["message"] == "busy"
    assert "decode" not in servers.bodies
    servers = FakeServers(no_params=True)
    response = post(proxy_module, servers, CLIENT_BODY)
    assert response.status_code == 502 and "kv_transfer_params" in response.text
    assert "decode" not in servers.bodies  # no silent recompute on the decode server
