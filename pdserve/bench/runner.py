"""Drives a benchmark: sends the requests open-loop (at scheduled times) or closed-loop (a fixed
number in flight), with an optional deadline and a progress bar on stderr.

The benchmark duration runs, as in `vllm bench serve`, from just before the first request is
scheduled until the last one has finished. At the deadline no new request is sent (those are
left out of the records) and requests still in flight are cut off by their timeout, so they
count as failed.
"""

import asyncio
import math
import time

from tqdm import tqdm

from pdserve.bench.client import Target, make_http_client, send
from pdserve.bench.records import RequestRecord
from pdserve.bench.workload import BenchRequest


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
    if (offsets is None) == (concurrency is None):
        raise ValueError("give exactly one of offsets (open loop) or concurrency (closed loop)")
    if offsets is not None and len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} send times for {len(requests)} requests")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")

    records: list[RequestRecord | None] = [None] * len(requests)
    failed = 0
    bar = tqdm(total=len(requests), unit="req", disable=not progress)
    async with make_http_client() as http:
        start = time.perf_counter()
        deadline = start + max_duration if max_duration else math.inf

        async def send_one(i: int) -> None:
            nonlocal failed
            remaining = deadline - time.perf_counter()
            records[i] = record = await send(http, target, requests[i], min(timeout, remaining))
            bar.update(1)
            if not record.ok:
                failed += 1
                bar.set_postfix(failed=failed)

        if offsets is not None:
            tasks = []
            for i, offset in enumerate(offsets):
                if start + offset >= deadline:
                    break
                await asyncio.sleep(start + offset - time.perf_counter())  # no-op if already late
                tasks.append(asyncio.create_task(send_one(i)))
            await asyncio.gather(*tasks)
        else:
            indices = iter(range(len(requests)))

            async def worker() -> None:
                for i in indices:  # shared iterator: each free worker takes the next request
                    if time.perf_counter() >= deadline:
                        return
                    await send_one(i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    bar.close()
    return [r for r in records if r is not None], duration


async def warm_up(
    requests: list[BenchRequest], target: Target, count: int, timeout: float = 600.0
) -> None:
    """Send the first `count` requests two at a time and forget them. A fresh vLLM engine on
    CPU answered its first requests several times slower than later ones (seen here: p90 TTFT
    2.7 s at the lowest rate of a first run, 0.9 s at a higher rate later), which would read as
    the first measurement's own latency."""
    if count:
        await run(requests[:count], target, concurrency=2, timeout=timeout, progress=False)
