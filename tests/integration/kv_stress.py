"""KV transfers under stress, shared by the tests of every transport: prefill workers killed
mid-transfer, and fifty requests aborted at random stages. Never a hang, never a wrong token,
never a leaked block or shared-memory segment."""

import asyncio
import json
import os
import random
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import psutil

from pdserve.core.kinds import RoutePath
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings.cluster_secret import secret_metadata
from tests.integration.conftest import SERVED_MODEL
from tests.integration.helpers import complete, router_sample
from tests.integration.processes import command_line, worker_pids
from tests.integration.prompts import DISAGGREGATED_PROMPTS, long_prompt
from tests.waiting import wait_for


def kill_prefill_workers_mid_transfer(server) -> None:
    """As many long prompts at once as there are prefill workers (round-robin gives each
    one), every prefill worker killed once its Stats show its prompt computing (no first token
    yet, so its KV is not complete): each prompt, its prefill worker lost, takes the local path
    (no prefill worker is left), long before the 30 s KV deadline, with the output the decode
    workers give the same prompt on their own (asked afterwards). The prompts are new to every
    worker's prefix cache, so each takes its prefill worker a while to compute."""
    pids = worker_pids(server, "prefill")
    ports = [worker_port(pid) for pid in pids]
    prompts = [f"Request {uuid.uuid4()}. {DISAGGREGATED_PROMPTS[-1]}" for _ in pids]
    before = router_sample(server, LOST_TO_LOCAL)
    started = time.monotonic()
    with ThreadPoolExecutor(len(pids)) as pool:
        sent = [
            pool.submit(complete, server, prompt, RoutePath.DISAGGREGATED) for prompt in prompts
        ]
        wait_for(
            lambda: all(computing_a_prompt(port) for port in ports),
            20,
            f"a prompt computing on every prefill worker ({ports})",
            poll_s=0.02,
        )
        for pid in pids:
            os.killpg(pid, signal.SIGKILL)
        responses = [future.result() for future in sent]
    assert time.monotonic() - started < 30, "a cancelled transfer waited for its deadline"
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.status_code == 200, response.text
        local = complete(server, prompt, RoutePath.LOCAL)
        assert response.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    assert router_sample(server, LOST_TO_LOCAL) - before == len(pids)
    # The decode workers still alive (a test before may have killed one: its row has an error).
    decodes = [w for w in server.workers(fresh=True) if w["role"] == "decode" and "error" not in w]
    assert decodes
    for decode in decodes:
        assert (decode["running_requests"], decode["kv_blocks_used"]) == (0, 0), decode


def worker_port(pid: int) -> int:
    """A worker's gRPC port, from the settings on its command line."""
    return json.loads(command_line(pid)[-1])["port"]


def worker_row(server, port: int) -> dict:
    """The router's row (the worker's live Stats) for the worker at `port`."""
    (row,) = [w for w in server.workers() if w["address"].endswith(f":{port}")]
    return row


def computing_a_prompt(port: int) -> bool:
    """Whether the worker at `port` has a prompt with no first token yet, from its own Stats
    (over gRPC, not through the router, whose reading adds a round trip to every worker: time
    enough for a short prompt to finish before the kill that the answer triggers)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=10, metadata=secret_metadata()
        )
    return stats.outstanding_prefill_tokens > 0


LOST_TO_LOCAL = 'pdserve_prefill_lost_total{next="local"}'


def abort_fifty_requests(server) -> None:
    """Fifty streamed requests, each cut off before its prefill ends, while its KV moves, or
    while decoding: afterwards every worker holds the KV blocks it held before, and no worker
    keeps more shared memory than its channels' segment pools (nothing in /dev/shm at all)."""
    shm_before = set(os.listdir("/dev/shm"))
    before = kv_baseline(server)
    rng = random.Random(7)

    async def stream(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": SERVED_MODEL,
            "prompt": long_prompt(rng.choice((150, 400, 700))) + f" Request {i}.",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        route = rng.choice(("disaggregated", "disaggregated", "local"))
        async with http.stream(
            "POST", f"{server.base_url}/completions", json=body, headers={"x-pdserve-route": route}
        ) as response:
            async for _ in response.aiter_lines():
                pass

    async def abort_all():
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(i: int):
                async with limit:
                    task = asyncio.create_task(stream(http, i))
                    # Before the prefill ends, while KV moves, or while decoding.
                    done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.05, 3.0))
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return not done

            return await asyncio.gather(*(one(i) for i in range(50)))

    aborted = asyncio.run(asyncio.wait_for(abort_all(), timeout=600))
    assert sum(aborted) >= 45  # each request could run ~10 s: nearly all were cut short
    wait_for_kv_baseline(server, before)
    assert set(os.listdir("/dev/shm")) <= shm_before, "a KV transfer left files in /dev/shm"
    for pid in worker_pids(server):
        segments = shared_memory_segments(pid)
        assert segments <= 8 * len(worker_pids(server, "prefill") or [1]), (pid, segments)


def answered_stats(server, timeout_s: float = 30) -> list[dict]:
    """Every worker's fresh Stats, asked again while one did not answer in time (a row with an
    `error`: a loaded CI host once let a Stats call pass its deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = server.workers(fresh=True)
        unanswered = [row for row in rows if "error" in row]
        if not unanswered:
            return rows
        assert time.monotonic() < deadline, f"Stats unanswered: {unanswered}"
        time.sleep(0.5)


def kv_baseline(server) -> dict[str, int]:
    """Each worker's KV blocks in use now (after an engine step)."""
    return {w["worker_id"]: w["kv_blocks_used"] for w in answered_stats(server)}


def wait_for_kv_baseline(server, before: dict[str, int], timeout_s: float = 60) -> dict:
    """Until every worker holds the KV blocks of `before` and runs nothing (failing after
    `timeout_s`); returns what they said last."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = {
            w["worker_id"]: (w["kv_blocks_used"], w["running_requests"])
            for w in answered_stats(server, timeout_s=max(0, deadline - time.monotonic()))
        }
        if after == {worker: (used, 0) for worker, used in before.items()}:
            return after
        assert time.monotonic() < deadline, f"KV still held: {after} (baseline {before})"
        time.sleep(0.5)


def shared_memory_segments(pid: int) -> int:
    """KV segments (memfds) open or mapped in a worker's process tree."""
    count = 0
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            count += sum("pdserve-kv" in m.path for m in process.memory_maps(grouped=False))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return count
