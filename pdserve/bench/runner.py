"""Drives a benchmark: sends the requests open-loop (at scheduled times) or closed-loop (a fixed
number in flight), with an optional deadline and its progress on stderr (pdserve/core/progress.py).

The benchmark duration runs, as in `vllm bench serve`, from just before the first request is
scheduled until the last one has finished. At the deadline no new request is sent (those are
left out of the records) and requests still in flight are cut off by their timeout, so they
count as failed. A `Session` is one such run; the unit it schedules is a job, which sends one
request here and a whole conversation in bench.conversation. `run_jobs` is the loop itself:
scripts/ drive it with jobs of their own (a request with headers, a gRPC call).
"""

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from pdserve.bench.client import Target, make_http_client, send
from pdserve.bench.records import RequestRecord
from pdserve.bench.workload import BenchRequest
from pdserve.core.progress import Progress


@dataclass
class Session:
    """One benchmark run: its HTTP client, clock, deadline and progress line."""

    http: httpx.AsyncClient
    target: Target
    timeout: float
    progress: Progress
    start: float
    deadline: float
    failed: int = 0
    duration: float = 0.0  # set when the session closes

    def past_deadline(self, after: float = 0.0) -> bool:
        """Whether the deadline is passed, or will be `after` seconds from now."""
        return time.perf_counter() + after >= self.deadline

    async def send(self, request: BenchRequest) -> RequestRecord:
        """Send one request, cut off at the deadline, and count it on the progress line."""
        remaining = self.deadline - time.perf_counter()
        record = await send(self.http, self.target, request, min(self.timeout, remaining))
        if not record.ok:
            self.failed += 1
        self.progress.advance(note=f"{self.failed} failed" if self.failed else "")
        return record

    async def run_jobs(
        self,
        count: int,
        job: Callable[[int], Awaitable[None]],
        offsets: list[float] | None,
        concurrency: int | None,
    ) -> None:
        """run_jobs on this session's clock and deadline."""
        await run_jobs(
            job,
            count=count,
            offsets=offsets,
            concurrency=concurrency,
            start=self.start,
            deadline=self.deadline,
        )


async def run_jobs(
    job: Callable[[int], Awaitable[None]],
    *,
    count: int | None = None,
    offsets: list[float] | None = None,
    concurrency: int | None = None,
    start: float | None = None,
    deadline: float = math.inf,
) -> None:
    """The one load loop of `pdserve bench` and scripts/: run job(0), job(1), ... each at its
    offset in seconds from `start` (open loop; default start: now), or `concurrency` at a time,
    each finished job replaced by the next (closed loop: `count` jobs, or until the deadline or
    cancellation when None). No job starts at or after `deadline` (time.perf_counter()); the
    job records what it measured."""
    if (offsets is None) == (concurrency is None):
        raise ValueError("give exactly one of offsets (open loop) or concurrency (closed loop)")
    if offsets is not None and count is not None and len(offsets) != count:
        raise ValueError(f"{len(offsets)} send times for {count} jobs")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    start = time.perf_counter() if start is None else start
    if offsets is not None:
        tasks = []
        try:
            for i, offset in enumerate(offsets):
                if start + offset >= deadline:
                    break
                await asyncio.sleep(start + offset - time.perf_counter())  # no-op if late
                tasks.append(asyncio.create_task(job(i)))
            await asyncio.gather(*tasks)
        finally:  # cancelled: the jobs started go too
            for task in tasks:
                task.cancel()
    else:
        indices = iter(range(count) if count is not None else itertools.count())

        async def worker() -> None:
            for i in indices:  # shared iterator: each free worker takes the next job
                if time.perf_counter() >= deadline:
                    return
                await job(i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


@asynccontextmanager
async def session(
    target: Target,
    total: int,
    timeout: float = 600.0,
    max_duration: float | None = None,
    progress: bool = True,
) -> AsyncIterator[Session]:
    """A session whose clock starts now; its `duration` is set on leaving. `total` is the number
    of requests the progress line expects."""
    line = Progress(total, "requests", enabled=progress)
    try:
        async with make_http_client() as http:
            start = time.perf_counter()
            deadline = start + max_duration if max_duration else math.inf
            running = Session(http, target, timeout, line, start, deadline)
            yield running
            running.duration = time.perf_counter() - start
    finally:
        line.close()


async def run(
    requests: list[BenchRequest],
    target: Target,
    *,
    offsets: list[float] | None = None,
    concurrency: int | None = None,
    timeout: float = 600.0,
    max_duration: float | None = None,
    progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send `requests` and return (records of the requests sent, in order; duration in seconds).

    Give exactly one of `offsets` (open loop: send times in seconds from the start, one per
    request) or `concurrency` (closed loop: each finished request is replaced by the next).
    """
    records: list[RequestRecord | None] = [None] * len(requests)
    async with session(target, len(requests), timeout, max_duration, progress) as running:

        async def send_one(i: int) -> None:
            records[i] = await running.send(requests[i])

        await running.run_jobs(len(requests), send_one, offsets, concurrency)
    return [r for r in records if r is not None], running.duration


async def warm_up(
    requests: list[BenchRequest], target: Target, count: int, timeout: float = 600.0
) -> None:
    """Send the first `count` requests two at a time and forget them. A fresh vLLM engine on
    CPU answered its first requests several times slower than later ones (seen here: p90 TTFT
    2.7 s at the lowest rate of a first run, 0.9 s at a higher rate later), which would read as
    the first measurement's own latency."""
    if count:
        await run(requests[:count], target, concurrency=2, timeout=timeout, progress=False)
