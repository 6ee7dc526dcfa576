"""Workers killed (SIGKILL) under load, on the session's mixed pool (3 prefill workers, one per
KV transport, and 2 decode workers, round-robin): round-robin spreads disaggregated requests
over every worker; a decode worker dies (its requests migrate to the other one); a prefill
worker dies (its prompts go to another prefill worker). Every request still succeeds, its
stream uninterrupted, with the greedy output an undisturbed run gives, and each killed
worker's vLLM engine processes die with it (no orphan). Last, every prefill worker is killed
mid-transfer: each prompt is recomputed correctly at once (in file order the pool needs no
restart; run alone, a test starts the pool again when too few workers are alive)."""

import asyncio
import json
import os
import signal
import time
import uuid

import httpx
import psutil
import pytest

from pdserve.worker.shm_leftovers import REAPER_MODULE as REAPER
from tests.integration.conftest import FORCED_TRANSPORTS, SERVED_MODEL
from tests.integration.helpers import router_sample
from tests.integration.http_client import HTTP
from tests.integration.kv_stress import (
    computing_a_prompt,
    kill_prefill_workers_mid_transfer,
    worker_port,
    worker_row,
)
from tests.integration.processes import group_members, worker_pids
from tests.integration.prompts import PROMPTS, long_prompt
from tests.waiting import wait_for

MAX_TOKENS = 48
REQUESTS = 18  # three rounds of CONCURRENCY: the kill comes in the first
CONCURRENCY = 6
MIGRATIONS, MIGRATION_GAP = "pdserve_migrations_total", "pdserve_migration_gap_seconds_sum"
RETRIED = 'pdserve_prefill_lost_total{next="another_prefill"}'
LOST_TO_LOCAL = 'pdserve_prefill_lost_total{next="local"}'
RECOMPUTED = 'pdserve_kv_fallbacks_total{policy="recompute"}'
# Short prompts (local path) and long ones (prefill worker, KV to the decode worker).
CASES = [(prompt, "local") for prompt in PROMPTS] + [
    (long_prompt(n) + f" Entry {n}.", "disaggregated") for n in (300, 500, 700)
]
# Two choices each: sampled with top_k 1 (no seed: each choice continues from its own tokens)
# and seeded (each choice is replayed with its seed): the decode-kill test's n > 1 requests.
CHOICES_CASES = [
    (CASES[0][0], "local", {"n": 2, "temperature": 1.0, "top_k": 1}),
    (CASES[-1][0], "disaggregated", {"n": 2, "temperature": 0.8, "seed": 7}),
]


@pytest.fixture(scope="module")
def undisturbed(mixed_pool) -> list[tuple[str, int]]:
    """Each case's streamed text and token count with every worker up, CONCURRENCY at a time
    (as the kill tests send them: batched so, the greedy answers are the same)."""
    server = mixed_pool()

    async def run_all():
        slots = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=300) as http:

            async def one(case):
                async with slots:
                    return await streamed(http, server, *case)

            return await asyncio.gather(*(one(case) for case in CASES + CHOICES_CASES))

    return asyncio.run(run_all())


async def streamed(
    http: httpx.AsyncClient, server, prompt: str, route: str, sampling: dict | None = None
) -> tuple[dict, int]:
    """Each choice's streamed text by index, and the number of tokens (greedy unless
    `sampling` says otherwise); fails on an error event."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(sampling or {}),
    }
    texts, tokens = {}, 0
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
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, tokens


def test_round_robin_spreads_disaggregated_requests_over_every_worker(mixed_pool):
    server = mixed_pool()
    body = {"model": SERVED_MODEL, "prompt": CASES[-1][0], "max_tokens": 2, "temperature": 0}
    pairs = set()
    for _ in range(2 * len(FORCED_TRANSPORTS)):
        reply = HTTP.post(
            f"{server.base_url}/completions",
            json=body,
            headers={"x-pdserve-route": "disaggregated"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        pairs.add((reply.headers["x-pdserve-prefill-worker"], reply.headers["x-pdserve-worker"]))
    prefill = {p for p, _ in pairs}
    decode = {d for _, d in pairs}
    print(f"{2 * len(FORCED_TRANSPORTS)} disaggregated requests went to {sorted(pairs)}")
    assert len(prefill) == len(FORCED_TRANSPORTS) and len(decode) == 2


def kill_under_fire(server, victim: int, cases, when) -> tuple[list, float]:
    """One streamed request per (prompt, route) of `cases`, CONCURRENCY at a time, SIGKILL of
    `victim` at the first moment `when()` says (polled; failing if it never does within 60 s).
    Returns each request's (text, tokens) and the seconds it all took; checks that the killed
    worker's engine processes died with it."""

    async def under_fire():
        limit = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=300) as http:

            async def one(*case):
                async with limit:
                    return await streamed(http, server, *case)

            async def kill():
                await asyncio.to_thread(wait_for, when, 60, "the moment to kill", 0.02)
                os.kill(victim, signal.SIGKILL)  # not its group: the engine is its own

            killer = asyncio.create_task(kill())
            results = await asyncio.gather(*(one(*case) for case in cases))
            await killer
            return results

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(under_fire(), timeout=900))
    seconds = time.monotonic() - started
    # The worker led its own process group, its engine processes in it: none outlives it.
    wait_for(lambda: not group_members(victim), 10, "the killed worker's engine processes gone")
    return results, seconds


def test_a_decode_worker_killed_mid_stream_fails_no_request(mixed_pool, undisturbed):
    server = mixed_pool(1, 2)
    victim = worker_pids(server, "decode")[0]
    assert len(group_members(victim)) >= 2  # the worker and its engine core
    assert any(  # and its reaper, in a session of its own (pdserve/worker/group_reaper.py)
        REAPER in " ".join(child.cmdline()) for child in psutil.Process(victim).children()
    )
    port = worker_port(victim)

    def decoding() -> bool:
        """Killed while it streams a request's tokens (its Stats: a request in its engine past
        its first token), which must then migrate; a request killed before its first token is
        only retried (seen in CI: a kill at a fixed time caught none decoding)."""
        worker = worker_row(server, port)
        return worker["running_requests"] > worker["prefilling_requests"]

    every = CASES + CHOICES_CASES
    # The n > 1 requests first: the kill comes at the first moment the victim decodes.
    order = [(i + len(CASES)) % len(every) for i in range(REQUESTS)]
    cases = [every[j] for j in order]
    before = {name: router_sample(server, name) for name in (MIGRATIONS, MIGRATION_GAP)}
    results, seconds = kill_under_fire(server, victim, cases, when=decoding)
    for i, result in enumerate(results):
        assert result == undisturbed[order[i]], f"request {i} differs from undisturbed"
    migrations = router_sample(server, MIGRATIONS) - before[MIGRATIONS]
    gap = (router_sample(server, MIGRATION_GAP) - before[MIGRATION_GAP]) / max(migrations, 1)
    with_choices = (server.log_dir / "serve.log").read_text().count("(2 choices)")  # the router's
    print(
        f"{REQUESTS} requests, 0 failed, one decode worker killed: {seconds:.1f} s; "
        f"migrated requests: {migrations:.0f}, mean pause {gap:.3f} s; "
        f"with 2 choices: {with_choices} (this session)"
    )
    assert migrations >= 1, "the killed worker was decoding nothing: the test proved nothing"


def test_a_prefill_worker_killed_under_load_fails_no_request(mixed_pool, undisturbed):
    """With one decode worker or two (whether the decode test ran before)."""
    server = mixed_pool(2, 1)
    victim = worker_pids(server, "prefill")[0]
    port = worker_port(victim)

    # Prompts new to the prefix caches: each still computes when the worker dies.
    nonce = uuid.uuid4().hex
    cases = []
    for i in range(REQUESTS):
        prompt, route = CASES[i % len(CASES)]
        if route == "disaggregated":
            prompt = f"Request {i} {nonce}. {prompt}"
        cases.append((prompt, route))
    before = {name: router_sample(server, name) for name in (RETRIED, LOST_TO_LOCAL, RECOMPUTED)}
    results, seconds = kill_under_fire(server, victim, cases, when=lambda: computing_a_prompt(port))

    async def as_if_undisturbed(i: int, prompt: str, route: str):
        if route == "local":
            return undisturbed[i % len(CASES)]
        async with httpx.AsyncClient(timeout=300) as http:  # the decode worker alone
            return await streamed(http, server, prompt, "local")

    for i, (case, result) in enumerate(zip(cases, results, strict=True)):
        assert result == asyncio.run(as_if_undisturbed(i, *case)), f"request {i} differs"
    retried, local, recomputed = (
        router_sample(server, name) - before[name] for name in (RETRIED, LOST_TO_LOCAL, RECOMPUTED)
    )
    print(
        f"{REQUESTS} requests, 0 failed, one prefill worker killed: {seconds:.1f} s; prompts "
        f"moved to the other prefill worker: {retried:.0f}, to the local path: {local:.0f}, "
        f"KV lost after the first token and recomputed: {recomputed:.0f}"
    )
    assert retried + recomputed >= 1, "the killed worker had no prompt: the test proved nothing"
    assert local == 0  # the other prefill worker was there to take them


def test_every_prefill_worker_killed_mid_transfer_is_recomputed(mixed_pool):
    """Every prefill worker alive (one or more, whether the tests before killed some)."""
    kill_prefill_workers_mid_transfer(mixed_pool(1, 1))
