"""Overload on a real router over real workers: three times more concurrent requests than it
may run and queue. Only 200s and 429s (with Retry-After and OpenAI's body), no 5xx, the router
still serves afterwards, and the admitted requests' latency stays bounded (printed). With
--max-queue-wait, a burst that would wait past it is refused at once, the larger priority class
first, and the admitted ones start within the limit (printed)."""

import asyncio
import statistics
import time

import httpx
import pytest

from tests.integration.conftest import SERVED_MODEL, router_in_front_of
from tests.integration.http_client import HTTP

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
        assert int(response.headers["retry-after"]) >= 1  # when the queue ahead drains
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    p99 = statistics.quantiles(admitted, n=100)[98] if len(admitted) > 1 else admitted[0]
    print(
        f"{REQUESTS} at once against {RUNNING} running + {QUEUED} queued: "
        f"{len(admitted)} x 200, {len(refused)} x 429, admitted p99 {p99:.2f} s"
    )
    assert p99 < 60
    after = HTTP.post(
        f"{small_router}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": "Still there?", "max_tokens": 2},
        timeout=60,
    )
    assert after.status_code == 200
    metrics = HTTP.get(f"{small_router}/metrics", timeout=10).text
    assert f"pdserve_rejected_total {float(len(refused))}" in metrics


BURST = 8 * RUNNING
# Turns that would come back within --max-queue-wait, all of them taken: of the burst's 16, about
# 2 + 6 are admitted when a request takes as long as it did when measured; some are refused
# unless the burst's requests are 2.3 times faster than that, some admitted unless 6 times slower.
TURNS_IN_LIMIT = 6


def completion(i: int, priority: int = 0) -> dict:
    return {
        "model": SERVED_MODEL,
        "prompt": f"Request {i}: the weather today is",
        "max_tokens": 24,
        "ignore_eos": True,
        "temperature": 0,
        "priority": priority,  # the body's field; the header is covered by the unit tests
    }


@pytest.fixture(scope="module")
def limited_router(server, tmp_path_factory):
    """Room in the queue for the whole burst: only the forecast refuses. The limit is set from
    a request's time on this machine (a turn comes back every half of it, two running), so
    that about TURNS_IN_LIMIT turns fit in it however fast the machine is: a fixed limit
    refused all or nothing on machines slower or faster than this one's. A request's time is the
    median of three after a first one, which may pay the cluster's one-time costs: measured
    alone, that first one (taken while the other stream's engines started) once set a limit the
    whole burst fit in."""
    seconds = []
    for _ in range(4):
        started = time.monotonic()
        response = HTTP.post(f"{server.url}/v1/completions", json=completion(-1), timeout=120)
        assert response.status_code == 200, response.text
        seconds.append(time.monotonic() - started)
    limit_s = TURNS_IN_LIMIT * statistics.median(seconds[1:]) / RUNNING
    with router_in_front_of(
        server,
        tmp_path_factory.mktemp("admission-limited"),
        max_concurrent_requests=RUNNING,
        max_queued_requests=BURST,
        queue_timeout_s=60,
        max_queue_wait_s=round(limit_s, 2),
    ) as url:
        yield url, round(limit_s, 2)


def test_a_burst_past_max_queue_wait_is_refused_at_once_larger_classes_first(limited_router):
    url, limit_s = limited_router

    async def one(http: httpx.AsyncClient, i: int):
        priority = i % 2
        started = time.monotonic()
        response = await http.post(f"{url}/v1/completions", json=completion(i, priority))
        return response, priority, time.monotonic() - started

    async def burst():
        async with httpx.AsyncClient(timeout=120) as http:
            warm, _, _ = await one(http, -2)  # a turn given back: the hold is learned
            assert warm.status_code == 200, warm.text
            return await asyncio.gather(*(one(http, i) for i in range(BURST)))

    results = asyncio.run(burst())
    assert {response.status_code for response, _, _ in results} <= {200, 429}
    refused = [
        (response, priority, s) for response, priority, s in results if response.status_code == 429
    ]
    admitted = [s for response, _, s in results if response.status_code == 200]
    assert refused, "the forecast refused nothing: the burst fit its limit"
    forecasts = [response.json()["error"]["message"] for response, _, _ in refused[:3]]
    assert len(admitted) > RUNNING, f"the forecast refused requests that fit: {forecasts}"
    for response, _, seconds in refused:
        assert seconds < limit_s, "a refusal waited: it should come at once"
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "would start in" in error["message"]
    by_class = [sum(priority == c for _, priority, _ in refused) for c in (0, 1)]
    assert by_class[0] < by_class[1], by_class  # the larger class is shed first
    p99 = statistics.quantiles(admitted, n=100, method="inclusive")[98]
    print(
        f"{BURST} at once against {RUNNING} running, --max-queue-wait {limit_s:g}: "
        f"{len(admitted)} x 200 (p99 {p99:.2f} s), "
        f"{len(refused)} x 429 (class 0/1: {by_class[0]}/{by_class[1]}); the first: {forecasts[0]}"
    )
