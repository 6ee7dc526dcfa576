"""bench.runner.run_jobs, the load loop `pdserve bench` and scripts/ share: which jobs it starts,
how many at once, and where it stops (no request is sent: the jobs only record themselves)."""

import asyncio
import time

import pytest

from pdserve.bench.runner import run_jobs

pytestmark = pytest.mark.timeout(60)


class RecordingJobs:
    """Jobs that note their index and the most of them ever in flight at once."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self, i: int) -> None:
        self.started.append(i)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # let the other jobs in
        self.in_flight -= 1


def test_closed_loop_runs_each_job_once_at_most_concurrency_at_a_time():
    jobs = RecordingJobs()
    asyncio.run(run_jobs(jobs, count=7, concurrency=3))
    assert sorted(jobs.started) == list(range(7))
    assert jobs.most_in_flight == 3


def test_open_loop_starts_the_due_jobs_in_order_and_none_due_after_the_deadline():
    jobs = RecordingJobs()
    start = time.perf_counter()
    asyncio.run(run_jobs(jobs, offsets=[0.0, 0.0, 0.0, 3600.0], start=start, deadline=start + 60))
    assert jobs.started == [0, 1, 2]  # the fourth is due after the deadline: never waited for


def test_closed_loop_without_count_runs_until_cancelled():
    async def scenario() -> list[int]:
        started: list[int] = []
        enough = asyncio.Event()

        async def job(i: int) -> None:
            started.append(i)
            if len(started) == 10:
                enough.set()
            await asyncio.sleep(0)

        load = asyncio.create_task(run_jobs(job, concurrency=2))
        await asyncio.wait_for(enough.wait(), timeout=30)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        ran = len(started)
        await asyncio.sleep(0)
        assert len(started) == ran  # nothing starts after the cancel
        return started

    started = asyncio.run(scenario())
    assert started[:10] == list(range(10))


def test_no_job_starts_after_the_deadline():
    jobs = RecordingJobs()
    asyncio.run(run_jobs(jobs, concurrency=2, deadline=time.perf_counter()))
    assert jobs.started == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"offsets": [0.0], "concurrency": 1}, "exactly one of"),
        ({"offsets": [0.0, 1.0], "count": 3}, "2 send times for 3 jobs"),
        ({"concurrency": 0}, "at least 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(run_jobs(RecordingJobs(), **kwargs))
