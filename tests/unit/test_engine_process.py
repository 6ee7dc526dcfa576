"""When a worker may open its gRPC port: after its engine's process is forked, or at once when
none will be (pdserve/worker/engine_process.py); and how that process starts."""

import asyncio
import multiprocessing
import os

import pytest

from pdserve.worker import engine_process
from pdserve.worker.engine_process import EngineProcessStart, core_ids, start_method


@pytest.mark.parametrize(
    "cpu, tp, chosen, bind, method",
    [
        (True, 1, None, "0,1", "fork"),  # the engine core runs the model: no fresh process
        (True, 2, None, "0|1", "spawn"),  # vLLM binds each rank's OpenMP threads at its start
        (True, 2, None, "auto", "spawn"),  # the same, on cores vLLM chooses
        (True, 2, None, "nobind", "fork"),  # nothing to bind: the ranks skip an import each
        (False, 4, None, "nobind", "fork"),  # vLLM's default on a GPU host
        (True, 1, "spawn", "nobind", "spawn"),  # the user's choice wins
    ],
)
def test_the_start_method(cpu, tp, chosen, bind, method):
    assert start_method(cpu, tp, chosen, bind) == method


def test_core_lists_read_as_vllm_writes_them():
    assert core_ids("0-3,6") == [0, 1, 2, 3, 6]
    assert core_ids("5") == [5]


@pytest.mark.parametrize(
    "bind, expected",
    [
        ("0-1,3", ("3", "{0,1,3}", "true")),
        ("nobind", None),
        ("auto", None),
        ("0,1|2,3", None),  # several ranks: vLLM's to apply
    ],
)
def test_a_single_core_list_becomes_the_openmp_binding(monkeypatch, bind, expected):
    for name in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(engine_process.OMP_BIND_ENV, bind)
    engine_process.bind_openmp_threads()
    got = tuple(os.environ.get(n) for n in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"))
    assert got == (expected or (None, None, None))


def _exit_at_once():
    os._exit(0)


def _wait_after(action) -> bool:
    """Whether `EngineProcessStart.wait` returned while a long engine start was still on."""

    async def run() -> bool:
        start = EngineProcessStart()
        release = asyncio.Event()
        starting = asyncio.create_task(release.wait())  # an engine start that never ends
        action(start)
        await asyncio.wait_for(start.wait(starting), timeout=10)
        done = starting.done()
        release.set()
        await starting
        return not done

    return asyncio.run(run())


def test_a_fork_opens_the_port():
    def fork(_start):
        child = multiprocessing.get_context("fork").Process(target=_exit_at_once)
        child.start()
        child.join(10)

    assert _wait_after(fork)


def test_no_fork_coming_opens_the_port_at_once():
    assert _wait_after(lambda start: start.no_fork_coming())


def test_an_engine_start_that_ends_before_any_fork_opens_the_port():
    async def run():
        start = EngineProcessStart()
        starting = asyncio.create_task(asyncio.sleep(0.05))  # failed before forking
        await asyncio.wait_for(start.wait(starting), timeout=10)
        return starting.done()

    assert asyncio.run(run())
