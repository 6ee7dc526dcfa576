"""A decode worker killed (SIGKILL, the worker process alone) under a steady stream of
requests: every request still succeeds, its stream uninterrupted, with the greedy output an
undisturbed run gives; the requests it was decoding migrate to the other decode worker; and
its vLLM engine processes die with it (no orphan)."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.conftest import SERVED_MODEL, _stop_and_check, start_server
from tests.integration.kv_stress import metric_value
from tests.integration.processes import children, command_line, group_members
from tests.integration.prompts import PROMPTS, long_prompt

MAX_TOKENS = 48
REQUESTS = 30
CONCURRENCY = 6
KILL_AFTER_S = 4.0
# Short prompts (local path) and long ones (prefill worker, KV to the decode worker).
CASES = [(prompt, "local") for prompt in PROMPTS] + [
    (long_prompt(n) + f" Entry {n}.", "disaggregated") for n in (300, 500, 700)
]


@pytest.fixture(scope="module")
def one_prefill_two_decode(smollm2_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("migration"), "--prefill", "1", "--decode", "2")
    yield server
    _stop_and_check(server)


async def streamed(http: httpx.AsyncClient, server, prompt: str, route: str) -> tuple[str, int]:
    """The streamed text and its number of tokens; fails on an error event."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, tokens = [], 0
    async with http.stream(
        "POST", f"{server.base_url}/completions", json=body, headers={"x-pdserve-route": route}
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            text += [choice["text"] for choice in event["choices"]]
    return "".join(text), tokens


def test_a_decode_worker_killed_mid_stream_fails_no_request(one_prefill_two_decode):
    server = one_prefill_two_decode

    async def undisturbed():
        async with httpx.AsyncClient(timeout=300) as http:
            return [await streamed(http, server, prompt, route) for prompt, route in CASES]

    reference = asyncio.run(undisturbed())
    decode_pids = [
        child
        for child in children(server.process.pid)
        if any('"role":"decode"' in part for part in command_line(child))
    ]
    assert len(decode_pids) == 2
    assert len(group_members(decode_pids[0])) >= 3  # the worker, its engine core, its reaper

    async def under_fire():
        limit = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=300) as http:

            async def one(i: int):
                async with limit:
                    prompt, route = CASES[i % len(CASES)]
                    return await streamed(http, server, prompt, route)

            async def kill():
                await asyncio.sleep(KILL_AFTER_S)
                os.kill(decode_pids[0], signal.SIGKILL)  # not its group: the engine is its own

            killer = asyncio.create_task(kill())
            results = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
            await killer
            return results

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(under_fire(), timeout=900))
    print(f"{REQUESTS} requests, one decode worker killed: {time.monotonic() - started:.1f} s")
    for i, (text, tokens) in enumerate(results):
        expected_text, expected_tokens = reference[i % len(CASES)]
        assert text == expected_text, f"request {i} differs from the undisturbed run"
        assert tokens == expected_tokens
    migrations = metric_value(server, "pdserve_migrations_total")
    gap = metric_value(server, "pdserve_migration_gap_seconds_sum") / max(migrations, 1)
    print(f"migrated requests: {migrations:.0f}, mean pause {gap:.3f} s")
    assert migrations >= 1, "the killed worker was decoding nothing: the test proved nothing"
    # The worker led its own process group, its engine processes in it: none outlives it.
    deadline = time.monotonic() + 10
    while group_members(decode_pids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(decode_pids[0]) == [], "the killed worker's engine processes live on"
