"""The router's pool membership (router/workers/pool.py): `sync` to a list of addresses,
`follow_registry`, `refresh` of workers marked down, and `max_model_len`. The pool's
WorkerClient is replaced by tests/fakes.py's FakeWorker, whose Health answers from a table the
test edits (READY, STARTING, or an UNAVAILABLE gRPC error), and the registry by a fake;
asyncio.run drives the coroutines. No worker process, no Redis, no network."""

import asyncio
import contextlib
import logging

import grpc
import pytest

import router.workers.pool
from pdserve.protocol import worker_pb2
from pdserve.protocol.registry import WorkerRecord
from router.workers.pool import RESTART_HOLD_S, WorkerPool, follow_load, follow_registry
from tests.fakes import FakeClock, FakeReplies, FakeWorker

READY, STARTING = worker_pb2.HealthReply.READY, worker_pb2.HealthReply.STARTING


class FakeWorkers:
    """Stands in for the worker processes behind the addresses: what each one's Health and
    Stats answer (tests/fakes.py's FakeReplies: an address with no Health reply is not
    listening), and every client (a FakeWorker) the pool made."""

    def __init__(self) -> None:
        self.answers = FakeReplies()
        self.stats = self.answers.stats  # address -> StatsReply, or the status code it fails with
        self.clients: list[FakeWorker] = []

    def up(
        self, address: str, role: str = "decode", max_model_len: int = 4096, state=READY
    ) -> None:
        self.answers.health[address] = worker_pb2.HealthReply(
            state=state,
            worker_id=f"id-{address}",
            role=role,
            max_model_len=max_model_len,
            kv_address=f"kv-{address}",
            tensor_parallel_size=1,
            max_num_seqs=4,
        )

    def gone(self, address: str) -> None:
        self.answers.health.pop(address, None)

    def client(self, address: str) -> FakeWorker:
        """A client of `address`, as the pool makes one: who it is comes from its Health."""
        client = FakeWorker(address, "", address=address, replies=self.answers)
        self.clients.append(client)
        return client

    def clients_of(self, address: str) -> list[FakeWorker]:
        return [client for client in self.clients if client.address == address]


class FakeRegistry:
    """Stands in for worker.registry.Registry: `members()` returns records for `addresses`, or
    raises while `failing` is set (Redis away); it counts its calls, and those asking `run_id`
    (its server's)."""

    def __init__(self, addresses: list[str]) -> None:
        self.url = "redis://fake-registry:6379/0"
        self.addresses = addresses
        self.failing = False
        self.calls = 0
        self.run_id = "first"  # another value: Redis restarted
        self.run_id_calls = 0

    async def server_run_id(self) -> str:
        self.run_id_calls += 1
        return self.run_id

    async def members(self) -> list[WorkerRecord]:
        self.calls += 1
        if self.failing:
            raise ConnectionError("Redis is away")
        return [
            WorkerRecord(worker_pb2.HealthReply(worker_id=f"id-{a}", role="decode"), a)
            for a in self.addresses
        ]


@pytest.fixture
def workers(monkeypatch) -> FakeWorkers:
    workers = FakeWorkers()
    monkeypatch.setattr(router.workers.pool, "WorkerClient", workers.client)
    return workers


def members(pool: WorkerPool) -> list[str]:
    return [worker.address for worker in pool.workers]


@contextlib.asynccontextmanager
async def following(pool: WorkerPool, registry: "FakeRegistry"):
    """follow_registry keeping `pool` in step with `registry` for the block (its task), from
    the moment every listed worker has joined; cancelled after."""
    task = asyncio.create_task(follow_registry(pool, registry, 0.01))
    try:
        await until(lambda: members(pool) == sorted(registry.addresses))
        yield task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until(condition, timeout_s: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while not condition():
        assert loop.time() < give_up, "timed out"
        await asyncio.sleep(0.005)


def test_a_new_address_joins_only_once_its_health_says_ready(workers):
    pool = WorkerPool([])
    asyncio.run(pool.sync(["a:1"]))  # not listening yet
    assert members(pool) == []
    workers.up("a:1", state=STARTING)
    asyncio.run(pool.sync(["a:1"]))  # loading the model
    assert members(pool) == []
    assert [client.closed for client in workers.clients_of("a:1")] == [True, True]
    workers.up("a:1", role="decode")
    asyncio.run(pool.sync(["a:1"]))
    assert members(pool) == ["a:1"]
    [joined] = pool.workers
    assert (joined.identity.worker_id, joined.role, joined.closed) == ("id-a:1", "decode", False)
    asyncio.run(pool.sync(["a:1"]))  # a member is not asked again
    assert len(workers.clients_of("a:1")) == 3
    assert pool.workers == [joined]


def test_a_worker_missing_from_membership_leaves_and_closes_once_its_requests_finish(workers):
    workers.up("a:1")
    workers.up("b:1")

    async def scenario():
        pool = WorkerPool([])
        await pool.sync(["a:1", "b:1"])
        busy = pool.workers[0]
        busy.users = 1
        pool.mark_down(busy)
        await pool.sync(["b:1"])
        assert members(pool) == ["b:1"]
        assert pool.leaving == [busy] and not busy.closed
        assert pool.down == set()  # a leaver is no longer anyone's concern for routing
        assert [w.address for w in pool.live(("decode",))] == ["b:1"]
        await pool.sync(["b:1"])
        assert pool.leaving == [busy] and not busy.closed
        busy.users = 0
        await pool.sync(["b:1"])
        assert pool.leaving == [] and busy.closed
        assert not pool.workers[0].closed

    asyncio.run(scenario())


def test_an_idle_worker_leaving_membership_is_closed_at_once(workers):
    workers.up("a:1")

    async def scenario():
        pool = WorkerPool([])
        await pool.sync(["a:1"])
        [idle] = pool.workers
        await pool.sync([])
        assert pool.workers == [] and pool.leaving == []
        assert idle.closed

    asyncio.run(scenario())


def test_following_the_registry_keeps_the_last_membership_while_it_cannot_be_read(workers, caplog):
    workers.up("a:1")
    workers.up("b:1")
    registry = FakeRegistry(["a:1", "b:1"])
    pool = WorkerPool([])

    async def scenario():
        async with following(pool, registry) as task:
            registry.failing = True
            failing_from = registry.calls
            await until(lambda: registry.calls >= failing_from + 3)
            assert members(pool) == ["a:1", "b:1"]
            assert pool.leaving == []
            registry.failing = False
            registry.addresses = ["b:1"]
            await until(lambda: members(pool) == ["b:1"])
            assert not task.done()

    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        asyncio.run(scenario())
    assert "cannot read the registry at redis://fake-registry:6379/0" in caplog.text
    assert "Redis is away" in caplog.text


def test_synced_is_set_once_the_first_read_has_every_ready_member_in_the_pools(workers):
    """The router's lifespan takes requests once `synced` is set (router/lifespan.py): a
    router (re)started beside serving workers must not answer "no worker has joined yet"."""
    workers.up("a:1")
    workers.up("b:1", state=STARTING)
    registry = FakeRegistry(["a:1", "b:1"])
    pool = WorkerPool([])
    synced = asyncio.Event()

    async def scenario():
        registry.failing = True
        task = asyncio.create_task(follow_registry(pool, registry, 0.01, synced=synced))
        try:
            await until(lambda: registry.calls >= 3)
            assert not synced.is_set()  # Redis away: nothing read yet
            registry.failing = False
            await asyncio.wait_for(synced.wait(), 2.0)
            assert members(pool) == ["a:1"]  # the ready one, already there when it is set
            assert pool.max_model_len == 4096
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_after_a_registry_restart_no_worker_leaves_while_they_register_again(workers):
    """A restarted Redis has lost every record until the workers' next heartbeats (a chaos soak
    once failed 60 requests with "no decode worker" in that second): the pool holds its
    members for RESTART_HOLD_S (of the pool's clock); one still missing after it leaves."""
    workers.up("a:1")
    workers.up("b:1")
    registry = FakeRegistry(["a:1", "b:1"])
    clock = FakeClock()
    pool = WorkerPool([], clock=clock)

    async def scenario():
        async with following(pool, registry):
            registry.addresses, registry.run_id = [], "second"  # restarted, empty
            calls = registry.calls
            await until(lambda: registry.calls >= calls + 5)
            assert members(pool) == ["a:1", "b:1"]
            registry.addresses = ["a:1"]  # a registered again; b never does
            calls = registry.calls
            await until(lambda: registry.calls >= calls + 5)
            assert members(pool) == ["a:1", "b:1"]  # held: the hold has not passed
            clock.advance(RESTART_HOLD_S)
            await until(lambda: members(pool) == ["a:1"])
            registry.addresses = []  # with no restart, a missing worker leaves at once
            await until(lambda: members(pool) == [], timeout_s=0.2)

    asyncio.run(scenario())


def test_the_run_id_is_asked_once_and_again_only_when_a_worker_would_leave(workers):
    """A poll whose members are all still registered costs one Redis call, not two."""
    workers.up("a:1")
    registry = FakeRegistry(["a:1"])
    pool = WorkerPool([])

    async def scenario():
        async with following(pool, registry):
            calls = registry.calls
            await until(lambda: registry.calls >= calls + 5)
            assert registry.run_id_calls == 1
            registry.addresses = []  # a:1 would leave: is Redis the same one?
            await until(lambda: members(pool) == [])
            assert registry.run_id_calls == 2

    asyncio.run(scenario())


def test_refresh_brings_back_a_worker_marked_down_once_it_answers_ready(workers):
    workers.up("a:1")
    workers.up("b:1")

    async def scenario():
        pool = WorkerPool([])
        await pool.sync(["a:1", "b:1"])
        flaky = pool.workers[0]
        pool.mark_down(flaky)
        assert pool.down == {"a:1"}
        assert [w.address for w in pool.live(("decode",))] == ["b:1"]
        workers.gone("a:1")
        await pool.refresh()
        assert pool.down == {"a:1"}
        workers.up("a:1", state=STARTING)
        await pool.refresh()
        assert pool.down == {"a:1"}
        workers.up("a:1")
        await pool.refresh()
        assert pool.down == set()
        assert [w.address for w in pool.live(("decode",))] == ["a:1", "b:1"]

    asyncio.run(scenario())


def test_max_model_len_is_the_smallest_member_and_the_last_known_when_the_pool_empties(
    workers,
):
    workers.up("a:1", max_model_len=8192)
    workers.up("b:1", role="prefill", max_model_len=2048)

    async def scenario():
        pool = WorkerPool([])
        assert pool.max_model_len == 0  # nobody joined yet
        await pool.sync(["a:1", "b:1"])
        assert pool.max_model_len == 2048
        await pool.sync(["a:1"])
        assert pool.max_model_len == 8192
        await pool.sync([])
        assert pool.workers == []
        assert pool.max_model_len == 8192

    asyncio.run(scenario())


def test_health_is_ok_only_while_a_worker_can_take_requests(workers):
    pool = WorkerPool([])
    workers.up("p:1", role="prefill")
    workers.up("d:1", role="decode")
    asyncio.run(pool.sync(["p:1", "d:1"]))
    serving, report = pool.health()
    assert serving and report["status"] == "ok"
    assert report["pools"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert sorted(report["workers"]) == ["id-d:1", "id-p:1"]
    pool.mark_down(next(w for w in pool.workers if w.role == "decode"))
    serving, report = pool.health()  # prefill workers alone cannot answer anyone
    assert not serving and report["status"] == "unavailable"
    assert report["down"] == ["id-d:1"] and report["pools"]["prefill"] == 1


async def follow_load_until(pool: WorkerPool, condition) -> None:
    """follow_load (polling every 10 ms) until `condition()` holds, for at most ~1 s."""
    task = asyncio.create_task(follow_load(pool, 0.01))
    try:
        for _ in range(200):
            if condition():
                break
            await asyncio.sleep(0.005)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_following_load_takes_each_report_and_marks_a_worker_that_is_gone_down(workers):
    for address in ("a:1", "b:1", "c:1"):
        workers.up(address)
    workers.stats["a:1"] = worker_pb2.StatsReply(running_requests=3, kv_blocks_total=10)
    workers.stats["b:1"] = grpc.StatusCode.DEADLINE_EXCEEDED  # busy, slow to answer
    workers.stats["c:1"] = grpc.StatusCode.UNAVAILABLE  # its process is gone

    async def scenario():
        pool = WorkerPool([])
        await pool.sync(["a:1", "b:1", "c:1"])
        a, b, c = pool.workers
        a.load.sent(prompt_tokens=5)
        await follow_load_until(pool, lambda: a.load.report is not None and pool.down)
        assert a.load.report.running_requests == 3 and a.load.requests_since == 0
        assert b.load.report is None and pool.down == {"c:1"}
        assert pool.capacity() == 4 + 4  # the two live ones' max_num_seqs

    asyncio.run(scenario())


def test_following_load_keeps_the_copy_of_a_host_kv_pool_and_asks_for_what_is_new(workers):
    """A worker in a host KV pool is asked for the pool's changes after the router's copy, and
    its answer updates the copy (router/workers/kv_pool_contents.py); a worker in no pool is not
    asked."""
    workers.up("a:1")
    workers.up("b:1")
    contents = worker_pb2.KvPoolContents(
        store_id="s", sequence=7, reset=True, added=[b"k" * 36], block_size=16, none_hash=b"n"
    )
    workers.stats["a:1"] = worker_pb2.StatsReply(kv_pool_contents=contents)
    workers.stats["b:1"] = worker_pb2.StatsReply()

    async def scenario():
        pool = WorkerPool([])
        await pool.sync(["a:1", "b:1"])
        a, b = pool.workers
        a.identity.host_id, a.identity.kv_pool = "host-1", "@pool"
        await follow_load_until(pool, lambda: a.asked is not None and a.asked.kv_pool_since == 7)
        assert (a.asked.kv_pool_store_id, a.asked.kv_pool_since) == ("s", 7)
        assert a.asked.kv_pool_contents and not b.asked.kv_pool_contents

    asyncio.run(scenario())
