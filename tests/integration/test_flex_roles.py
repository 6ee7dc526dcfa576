"""Flex workers on one real cluster (`pdserve serve --flex 3 --routers 2`): roles change under a
steady stream of greedy requests with no engine restart, every request succeeds with vLLM's
offline output, a worker moved to the prefill pool finishes the decodes it had, and no KV block
leaks. Its two routers share the split through the Redis `serve` started: a change through one
is in effect at the other within a second, and a third router joining that state, killed under
load, leaves the others serving the retries of its clients.
"""

import asyncio
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from pdserve.settings.redis_url import PASSWORD_ENV
from tests.integration.conftest import (
    SERVED_MODEL,
    _stop_and_check,
    router_in_front_of,
    router_over,
    start_server,
)
from tests.integration.http_client import HTTP
from tests.integration.kv_stress import kv_baseline, wait_for_kv_baseline
from tests.integration.processes import children, command_line
from tests.integration.prompts import MAX_TOKENS, PROMPTS, long_prompt
from tests.waiting import until, wait_for

SPLITS = [2, 1, 2]  # prefill workers after each change (the cluster starts at 1 prefill, 2 decode)
CONCURRENCY = 3
LONG_MAX_TOKENS = 128  # seconds of decoding on this machine
BURST = 6  # long prompts at once: seconds of backlog for one prefill worker


@pytest.fixture(scope="module")
def flex_server(smollm2_dir, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("flex"), "--flex", "3", "--routers", "2")
    yield server
    _stop_and_check(server)


@pytest.fixture
def flex_cluster(flex_server):
    """The module's cluster, put back to its starting split (1 prefill, 2 decode) after each
    test, so the next one finds it as started."""
    yield flex_server
    set_split(flex_server, 1)


def roles(server) -> dict[str, str]:
    return roles_at(server.url)


def roles_at(url: str) -> dict[str, str]:
    view = HTTP.get(f"{url}/pdserve/roles", timeout=10).json()
    return {row["worker"]: row["role"] for row in view["workers"]}


def second_router(server) -> str:
    """`serve --routers 2`'s other router: on the first one's port + 1."""
    host, port = server.url.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


def routers_counted(url: str) -> float:
    metrics = HTTP.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^pdserve_routers (\S+)$", metrics, re.M).group(1))


def set_split(server, prefill: int) -> dict:
    reply = HTTP.post(f"{server.url}/pdserve/roles", json={"prefill": prefill}, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


async def complete(
    http: httpx.AsyncClient, server, index: int, max_tokens: int = MAX_TOKENS
) -> dict:
    """A greedy request on the disaggregated path: its text and the workers that served it."""
    started_at = time.monotonic()
    reply = await http.post(
        f"{server.base_url}/completions",
        json={
            "model": SERVED_MODEL,
            "prompt": PROMPTS[index],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": max_tokens == LONG_MAX_TOKENS,  # seconds of decoding, whatever comes
        },
        headers={"x-pdserve-route": "disaggregated"},
    )
    assert reply.status_code == 200, reply.text
    return {
        "index": index,
        "text": reply.json()["choices"][0]["text"],
        "prefill": reply.headers["x-pdserve-prefill-worker"],
        "decode": reply.headers["x-pdserve-worker"],
        "started_at": started_at,
        "finished_at": time.monotonic(),
        "request_id": reply.headers["x-request-id"],  # to find it in the router's log
    }


def roles_story(server, request_id: str) -> str:
    """The lines of the routers' log that move flex workers, place them or name the request."""
    log = (server.log_dir / "serve.log").read_text(errors="replace").splitlines()
    marks = ("flex worker", " joined", " left", request_id)
    return "\n".join(line[:300] for line in log if any(mark in line for mark in marks))


def test_the_cluster_starts_one_prefill_two_decode(flex_cluster):
    assert sorted(roles(flex_cluster).values()) == ["decode", "decode", "prefill"]


def test_roles_change_under_load_with_no_failure_and_vllms_output(flex_cluster, offline_reference):
    before = kv_baseline(flex_cluster)
    changes = []  # (when it was asked, when it had taken effect, the roles then)

    async def scenario():
        stop = asyncio.Event()
        done: list[dict] = []  # every request so far, as it completes
        async with httpx.AsyncClient(timeout=300) as http:

            async def stream_of_requests(offset: int) -> None:
                i = offset
                while not stop.is_set():
                    done.append(await complete(http, flex_cluster, i % len(PROMPTS)))
                    i += 1

            async def requests_since(moment: float) -> None:
                """Until CONCURRENCY requests sent after `moment` have completed."""
                await until(
                    lambda: sum(r["started_at"] > moment for r in done) >= CONCURRENCY,
                    120,
                    f"{CONCURRENCY} requests under the roles of that moment",
                )

            loops = [asyncio.create_task(stream_of_requests(i)) for i in range(CONCURRENCY)]
            await requests_since(0.0)
            for prefill in SPLITS:
                started = time.monotonic()
                reply = await asyncio.to_thread(set_split, flex_cluster, prefill)
                # The change itself, as the router timed it, is quick; the round trip also
                # queues behind the streams on a busy host, yet stays far from an engine's
                # restart (~25 s here).
                assert reply["seconds"] < 2.0 and time.monotonic() - started < 10.0
                assert reply["flex"] == {"prefill": prefill, "decode": 3 - prefill, "standby": 0}
                now = await asyncio.to_thread(roles, flex_cluster)
                changes.append((started, time.monotonic(), now))
                await requests_since(changes[-1][1])
            stop.set()
            await asyncio.gather(*loops)
            return done

    results = asyncio.run(scenario())
    print(f"{len(results)} requests over {len(SPLITS)} role changes")
    assert len(results) >= 3 * CONCURRENCY
    for result in results:
        assert result["text"] == offline_reference["prompts"][result["index"]]["text"]
    # Requests sent after a change took effect used its pools, if they were answered before
    # the next change was asked: one sent just before may be routed after the next change,
    # which can overtake it on its way through the router (its admission, its tokenization).
    ends = [asked for asked, _, _ in changes[1:]] + [float("inf")]
    for (_, effective, now), end in zip(changes, ends, strict=True):
        later = [r for r in results if effective < r["started_at"] and r["finished_at"] < end]
        assert later, "no request ran under the new roles"
        for result in later:
            assert now[result["prefill"]] == "prefill" and now[result["decode"]] == "decode", (
                f"{result} under {now} (in effect from {effective:.2f}); the routers' moves "
                f"and the request: {roles_story(flex_cluster, result['request_id'])}"
            )
    wait_for_kv_baseline(flex_cluster, before)


def test_a_worker_moved_to_prefill_finishes_its_decodes(flex_cluster):
    """Two decode workers: round-robin gives each one request."""

    def both_decoding() -> bool:
        rows = [w for w in flex_cluster.workers() if w["role"] == "decode"]
        return len(rows) == 2 and all(
            w["running_requests"] > w["prefilling_requests"] for w in rows
        )

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as http:
            running = [
                asyncio.create_task(complete(http, flex_cluster, i, LONG_MAX_TOKENS))
                for i in range(2)
            ]
            await asyncio.to_thread(wait_for, both_decoding, 60, "both decode workers decoding")
            assert not any(task.done() for task in running)
            moved = (await asyncio.to_thread(set_split, flex_cluster, 2))["changes"]
            results = [await task for task in running]
            undisturbed = await asyncio.gather(
                *(complete(http, flex_cluster, i, LONG_MAX_TOKENS) for i in range(2))
            )
            return moved, results, undisturbed

    moved, results, undisturbed = asyncio.run(scenario())
    [change] = moved
    assert (change["from"], change["to"]) == ("decode", "prefill")
    assert change["worker"] in {r["decode"] for r in results}, "it was decoding when moved"
    assert [r["text"] for r in results] == [r["text"] for r in undisturbed]


def test_a_split_that_leaves_no_decode_worker_is_refused(flex_cluster):
    reply = HTTP.post(f"{flex_cluster.url}/pdserve/roles", json={"prefill": 3}, timeout=10)
    assert reply.status_code == 400
    assert "at least one worker must decode" in reply.json()["error"]["message"]


def test_the_automatic_ratio_follows_a_burst_of_long_prompts(flex_cluster, tmp_path):
    """A second router over the same workers, with --flex-auto: a burst of long prompts backs
    up its one prefill worker, so a decode worker joins the prefill pool; once the burst is over
    it goes back. Every move is logged with the figures behind it."""
    with router_in_front_of(flex_cluster, tmp_path, flex_auto=True, flex_auto_backlog=1000) as url:
        assert HTTP.get(f"{url}/pdserve/roles", timeout=10).json()["flex"]["prefill"] == 1
        seen = []

        async def burst():
            async with httpx.AsyncClient(timeout=300) as http:
                body = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0}
                sent = [
                    asyncio.create_task(
                        http.post(
                            f"{url}/v1/completions",
                            # Distinct from the first token on: no prefix-cache hit.
                            json={**body, "prompt": f"Entry {i}. " + long_prompt(1200)},
                            headers={"x-pdserve-route": "disaggregated"},
                        )
                    )
                    for i in range(BURST)
                ]
                while not all(task.done() for task in sent):
                    view = (await http.get(f"{url}/pdserve/roles")).json()
                    seen.append(view["flex"]["prefill"])
                    await asyncio.sleep(0.5)
                return [task.result().status_code for task in sent]

        assert asyncio.run(burst()) == [200] * BURST
        assert max(seen) == 2, seen
        wait_for(
            lambda: HTTP.get(f"{url}/pdserve/roles", timeout=10).json()["flex"]["prefill"] == 1,
            60,
            "the prefill pool giving its extra worker back",
            poll_s=0.5,
        )
        moves = [
            line for line in (tmp_path / "router.log").read_text().splitlines() if "auto:" in line
        ]
        print("\n".join(moves))
        assert len(moves) == 2 and "prefill_backlog_per_worker=" in moves[0]


def test_a_split_set_through_one_router_is_in_effect_at_the_other_within_a_second(flex_cluster):
    other = second_router(flex_cluster)
    started = roles(flex_cluster)  # the split the last test put back, shared within a round
    wait_for(lambda: roles_at(other) == started, 5, "both routers to agree")
    counted = lambda: routers_counted(flex_cluster.url) == routers_counted(other) == 2  # noqa: E731
    wait_for(counted, 5, "each router counting both")
    # Timed from the answer (the split is in Redis by then) to the first poll that sees it at
    # the other router, polled without a pause (no round trip of this test's own in between).
    reply = set_split(flex_cluster, 2)
    changed_at = time.monotonic()
    wanted = {row["worker"]: row["role"] for row in reply["workers"]}
    wait_for(lambda: roles_at(other) == wanted, 5, "the other router to take the split", 0)
    seconds = time.monotonic() - changed_at
    print(f"a split set through one router in effect at the other after {seconds:.2f} s")
    assert seconds < 1.0
    prefill = {worker for worker, role in wanted.items() if role == "prefill"}
    for index in range(2):  # each of the new prefill pool's workers may be picked
        reply = HTTP.post(
            f"{other}/v1/completions",
            json={"model": SERVED_MODEL, "prompt": PROMPTS[index], "max_tokens": 4},
            headers={"x-pdserve-route": "disaggregated"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-pdserve-prefill-worker"] in prefill


STREAMS = 3
STREAM_TOKENS = 64  # seconds of decoding: the streams are running when their router dies


def test_a_router_killed_under_load_leaves_the_others_serving_its_clients_retries(
    flex_cluster, tmp_path, monkeypatch
):
    """A third router joins the shared state (its URL from serve's log, the password from
    another router's environment, as an operator's would come from a Secret), serves streams, and is
    SIGKILLed once every stream has its first token; each client retries at the first router."""
    serve_log = (flex_cluster.log_dir / "serve.log").read_text()
    url = re.search(r"shared state: redis-server at (\S+)", serve_log).group(1)
    (router_1,) = [  # serve set the password after it started: its children have it
        child for child in children(flex_cluster.process.pid) if "router" in command_line(child)
    ]
    password = psutil.Process(router_1).environ()[PASSWORD_ENV]
    monkeypatch.setenv(PASSWORD_ENV, password)  # the third router inherits it
    addresses = [worker["address"] for worker in flex_cluster.workers()]
    with router_over(addresses, tmp_path, registry=url) as third:
        wait_for(lambda: routers_counted(flex_cluster.url) == 3, 10, "three routers counted")
        assert roles_at(third) == roles(flex_cluster)  # it took the shared split
        port = int(third.rsplit(":", 1)[1])
        (pid,) = [
            child
            for child in children(os.getpid())
            if any(f'"port": {port}' in part for part in command_line(child))
        ]
        body = {
            "model": SERVED_MODEL,
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }

        async def client(http: httpx.AsyncClient, index: int, streaming: asyncio.Event, n: list):
            request = {**body, "prompt": PROMPTS[index], "stream": True}
            try:
                async with http.stream("POST", f"{third}/v1/completions", json=request) as reply:
                    async for line in reply.aiter_lines():
                        if line.startswith("data: {"):
                            n.append(index)
                            if len(set(n)) == STREAMS:
                                streaming.set()
                return "finished at the third router"
            except httpx.TransportError:  # its router died mid-stream: retry at another
                retry = await http.post(
                    f"{flex_cluster.base_url}/completions", json={**body, "prompt": PROMPTS[index]}
                )
                assert retry.status_code == 200, retry.text
                assert retry.json()["usage"]["completion_tokens"] == STREAM_TOKENS
                return "retried at the first router"

        async def scenario():
            streaming, started = asyncio.Event(), []
            async with httpx.AsyncClient(timeout=120) as http:
                clients = [
                    asyncio.create_task(client(http, i, streaming, started)) for i in range(STREAMS)
                ]
                await asyncio.wait_for(streaming.wait(), 60)
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                return await asyncio.gather(*clients)

        outcomes = asyncio.run(scenario())
    print(f"{STREAMS} streams at a router killed mid-stream: {outcomes}")
    assert "retried at the first router" in outcomes
    # Each router counts the others' presences at its own sync round (every PRESENCE_EVERY_S):
    # the second may see the dead one gone a round after the first does.
    for url in (flex_cluster.url, second_router(flex_cluster)):
        wait_for(lambda u=url: routers_counted(u) == 2, 10, f"the dead router uncounted at {url}")
