"""Hung and flapping workers. Router side: a worker whose calls go unanswered (its process
alive, its port open: SIGSTOP, a blocked event loop) leaves the pools after the deadline and
returns once it answers again, later each time it flaps (router/workers/liveness.py,
router/workers/pool.py). Keeper side: which workers whose process runs the replica keeper
replaces anyway (pdserve/cluster/hung_workers.py).

The rules are tested with times passed in; the router's whole loop with its real WorkerClient
against fake gRPC workers on 127.0.0.1 whose handlers can be made to hang, on a fake clock."""

import asyncio

import grpc
import pytest

from pdserve.cluster.hung_workers import READY_DEADLINE_S, SILENT_S, why_hung
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from router.metrics import RouterMetrics
from router.workers.liveness import BACK_AFTER_S, FLAP_WINDOW_S, MAX_BACK_AFTER_S, Liveness
from router.workers.pool import WorkerPool, follow_load
from tests.fakes import FakeClock

DEADLINE_S = 10.0


def test_a_worker_silent_past_the_deadline_goes_out_once():
    liveness = Liveness(last_answer=0.0)
    assert not liveness.goes_out(DEADLINE_S, DEADLINE_S)  # exactly at the deadline: still in
    assert liveness.goes_out(DEADLINE_S + 0.1, DEADLINE_S)
    assert not liveness.serving
    assert not liveness.goes_out(DEADLINE_S + 5, DEADLINE_S)  # counted once per out


def test_a_worker_taken_out_returns_only_after_answering_unbroken():
    liveness = Liveness(last_answer=0.0)
    liveness.goes_out(11.0, DEADLINE_S)
    liveness.answered(12.0)
    assert not liveness.comes_back(12.0 + BACK_AFTER_S / 2)  # not long enough yet
    liveness.missed()  # a call timed out: the run starts over
    liveness.answered(13.0)
    assert not liveness.comes_back(13.0 + BACK_AFTER_S - 0.1)
    liveness.answered(13.0 + BACK_AFTER_S)
    assert liveness.comes_back(13.0 + BACK_AFTER_S)
    assert liveness.serving


def test_a_stale_answer_does_not_bring_it_back():
    liveness = Liveness(last_answer=0.0)
    liveness.goes_out(11.0, DEADLINE_S)
    liveness.answered(12.0)  # one answer, then its next call hangs (no miss yet)
    assert not liveness.comes_back(30.0)


def test_each_flap_doubles_the_time_out_up_to_a_cap():
    liveness, now, waits = Liveness(last_answer=0.0), 0.0, []
    for _ in range(8):
        now += DEADLINE_S + 1
        assert liveness.goes_out(now, DEADLINE_S)
        waits.append(liveness.back_after(now))
        liveness.answered(now)
        now += waits[-1]
        liveness.answered(now)
        assert liveness.comes_back(now)
    assert waits[:4] == [BACK_AFTER_S, 2 * BACK_AFTER_S, 4 * BACK_AFTER_S, 8 * BACK_AFTER_S]
    assert waits[-1] == MAX_BACK_AFTER_S
    now += FLAP_WINDOW_S + DEADLINE_S + 1  # quiet for a window: the old outs no longer count
    assert liveness.goes_out(now, DEADLINE_S) and liveness.back_after(now) == BACK_AFTER_S


class FakeHangingWorker(worker_pb2_grpc.WorkerServicer):
    """A fake worker (Health and Stats only) whose handlers, while `hung` is set, wait until it
    is cleared, as a SIGSTOPped process would leave its callers waiting."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.running = asyncio.Event()
        self.running.set()
        self.stats_served = 0

    def hang(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    async def Health(self, request, context):
        await self.running.wait()
        return worker_pb2.HealthReply(
            state=worker_pb2.HealthReply.READY,
            worker_id=self.worker_id,
            role="decode",
            max_model_len=4096,
            max_num_seqs=4,
        )

    async def Stats(self, request, context):
        await self.running.wait()
        self.stats_served += 1
        return worker_pb2.StatsReply(worker_id=self.worker_id, running_requests=1)


async def serve(worker: FakeHangingWorker) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def until(condition, timeout_s: float = 10.0) -> None:
    """Until `condition()` holds; fails the test past `timeout_s` (a bound, not a measure)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not condition():
        if loop.time() > give_up:
            pytest.fail(f"not within {timeout_s} s")
        await asyncio.sleep(0.02)


def test_a_hung_worker_leaves_the_pools_and_returns_when_it_answers_again():
    """The pool's clock is a fake the test advances, half a second at a time and only once the
    healthy worker has answered since (the hung one's call waits meanwhile)."""
    deadline_s, interval_s, clock = 5.0, 0.02, FakeClock()

    async def scenario():
        hung, healthy = FakeHangingWorker("decode-hung"), FakeHangingWorker("decode-ok")
        servers = [await serve(hung), await serve(healthy)]
        pool = WorkerPool([address for _, address in servers], clock=clock)
        metrics = RouterMetrics()
        following = asyncio.create_task(follow_load(pool, interval_s, deadline_s, metrics))

        async def advance(seconds: float) -> None:
            for _ in range(round(seconds / 0.5)):
                clock.advance(0.5)
                served = healthy.stats_served
                await until(lambda served=served: healthy.stats_served >= served + 2)

        try:
            await pool.wait_ready(5.0)
            assert len(pool.live(("decode",))) == 2
            hung.hang()
            await advance(deadline_s)
            assert len(pool.live(("decode",))) == 2  # silent, but not past its deadline
            await advance(1.0)
            await until(lambda: len(pool.live(("decode",))) == 1)
            (left,) = pool.live(("decode",))
            assert left.identity.worker_id == "decode-ok"
            sample = metrics.registry.get_sample_value
            assert sample("pdserve_worker_unresponsive_total", {"role": "decode"}) == 1
            assert sample("pdserve_unresponsive_workers") == 1
            assert pool.health()[1]["unresponsive"] == ["decode-hung"]
            hung.resume()
            answered = hung.stats_served
            await until(lambda: hung.stats_served >= answered + 2)
            await advance(BACK_AFTER_S - 0.5)
            assert len(pool.live(("decode",))) == 1  # hysteresis: it must keep answering first
            await advance(1.0)
            await until(lambda: len(pool.live(("decode",))) == 2)
            assert sample("pdserve_unresponsive_workers") == 0
            assert sample("pdserve_worker_unresponsive_total", {"role": "decode"}) == 1
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            hung.resume()
            await pool.close()
            for server, _ in servers:
                await server.stop(None)

    asyncio.run(scenario())


def test_the_keeper_replaces_a_worker_never_ready_within_its_start_deadline():
    assert why_hung(started_at=100.0, last_listed=None, now=100.0 + READY_DEADLINE_S) is None
    why = why_hung(started_at=100.0, last_listed=None, now=101.0 + READY_DEADLINE_S)
    assert why is not None and "not ready" in why


def test_the_keeper_replaces_a_worker_out_of_the_registry_too_long_but_not_a_late_heartbeat():
    assert why_hung(started_at=0.0, last_listed=50.0, now=50.0 + SILENT_S) is None
    why = why_hung(started_at=0.0, last_listed=50.0, now=51.0 + SILENT_S)
    assert why is not None and "hung" in why
    # One seen recently is judged by its last sighting, however long ago it started.
    assert (
        why_hung(started_at=0.0, last_listed=2 * READY_DEADLINE_S, now=2 * READY_DEADLINE_S) is None
    )
