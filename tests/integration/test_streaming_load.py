"""Streams under load and streams cut short, against the real router and worker."""

import asyncio
import time

import httpx
import openai
import pytest

from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP
from tests.integration.kv_stress import kv_baseline, wait_for_kv_baseline
from tests.waiting import wait_for


def test_client_disconnect_aborts_the_request_on_the_worker(server):
    # ignore_eos: the request would run for ~100 s if nothing aborted it.
    body = {
        "model": SERVED_MODEL,
        "prompt": "Count from one to a thousand:",
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
            assert response.status_code == 200
            # Hold the line iterator: dropping it would close the connection right here.
            lines = response.iter_lines()
            events = 0
            while events < 5:
                events += next(lines).startswith("data:")
            assert server.worker("decode")["running_requests"] == 1
    # Leaving the `with` closed the connection mid-stream.
    wait_for(
        lambda: server.worker("decode")["running_requests"] == 0,
        2.0,
        "the worker no longer running the abandoned request",
    )
    metrics = HTTP.get(f"{server.url}/metrics", timeout=10).text
    assert 'pdserve_errors_total{kind="client_disconnect"}' in metrics


def test_client_leaving_a_whole_response_aborts_it_too(server):
    body = {
        "model": SERVED_MODEL,
        "prompt": "Count from one to a thousand:",
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up after 3 s, closing its connection.
        HTTP.post(f"{server.base_url}/completions", json=body, timeout=3)
    wait_for(
        lambda: server.worker("decode")["running_requests"] == 0,
        2.0,
        "the worker no longer running the abandoned request",
    )


def test_twenty_concurrent_streams_all_complete(server):
    max_tokens = 16

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=SERVED_MODEL,
            prompt=f"Story number {i}: once upon a time",
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens, finish

    async def all_of_them():
        client = openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", timeout=300, max_retries=0
        )
        try:
            return await asyncio.gather(*(one(client, i) for i in range(20)))
        finally:
            await client.close()

    results = asyncio.run(asyncio.wait_for(all_of_them(), timeout=300))
    assert len(results) == 20
    for text, completion_tokens, finish in results:
        assert text
        assert finish in ("stop", "length")
        assert (
            completion_tokens == max_tokens
            if finish == "length"
            else completion_tokens < (max_tokens)
        )
    assert server.worker("decode")["running_requests"] == 0


def test_eighty_streams_aborted_after_their_first_token_give_back_every_kv_block(server):
    """80 streams at once, half disaggregated, each dropped by its client as soon as its first
    token arrives: every worker's KV blocks go back to what they were before, nothing runs."""
    before = kv_baseline(server)

    async def first_token_then_leave(http: httpx.AsyncClient, i: int) -> bool:
        body = {
            "model": SERVED_MODEL,
            "prompt": f"Story number {i}: once upon a time",
            "max_tokens": 500,
            "ignore_eos": True,
            "stream": True,
        }
        route = "disaggregated" if i % 2 else "local"
        async with http.stream(
            "POST", f"{server.base_url}/completions", json=body, headers={"x-pdserve-route": route}
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"text":""' not in line:
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def all_of_them():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(first_token_then_leave(http, i) for i in range(80)))

    started = time.monotonic()
    got_a_token = asyncio.run(asyncio.wait_for(all_of_them(), timeout=300))
    assert all(got_a_token)
    after = wait_for_kv_baseline(server, before)
    print(
        f"80 streams aborted after their first token; KV back to baseline "
        f"{time.monotonic() - started:.1f} s after they started: {after}"
    )
