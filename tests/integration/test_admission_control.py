"""Overload on a real router over real workers: three times more concurrent requests than it
may run and queue. Only 200s and 429s (with Retry-After and OpenAI's body), no 5xx, the router
still serves afterwards, and the admitted requests' latency stays bounded (printed)."""

import asyncio
import statistics
import time

import httpx
import pytest

from tests.integration.conftest import SERVED_MODEL, router_in_front_of

RUNNING, QUEUED = 2, 2
REQUESTS = 3 * (RUNNING + QUEUED)


@pytest.fixture(scope="module")
def small_router(server, tmp_path_factory):
    with router_in_front_of(
        server,
        tmp_path_factory.mktemp("admission"),
        max_concurrent_requests=RUNNING,
        max_queued_requests=QUEUED,
        queue_timeout_s=20,
    ) as url:
        yield url


def test_three_times_capacity_gets_only_200_and_429(small_router):
    async def one(http: httpx.AsyncClient, i: int):
        started = time.monotonic()
        response = await http.post(
            f"{small_router}/v1/completions",
            json={
                "model": SERVED_MODEL,
                "prompt": f"Request {i}: the weather today is",
                "max_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        return response, time.monotonic() - started

    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(REQUESTS)))

    results = asyncio.run(burst())
    statuses = sorted(response.status_code for response, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    admitted = [seconds for response, seconds in results if response.status_code == 200]
    refused = [response for response, _ in results if response.status_code == 429]
    assert len(admitted) >= RUNNING + QUEUED  # what fits was served...
    assert refused, "nothing was refused: the burst did not exceed the bounds"  # ...not more
    for response in refused:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    p99 = statistics.quantiles(admitted, n=100)[98] if len(admitted) > 1 else admitted[0]
    print(
        f"{REQUESTS} at once against {RUNNING} running + {QUEUED} queued: "
        f"{len(admitted)} x 200, {len(refused)} x 429, admitted p99 {p99:.2f} s"
    )
    assert p99 < 60
    after = httpx.post(
        f"{small_router}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": "Still there?", "max_tokens": 2},
        timeout=60,
    )
    assert after.status_code == 200
    metrics = httpx.get(f"{small_router}/metrics", timeout=10).text
    assert f"pdserve_rejected_total {float(len(refused))}" in metrics
