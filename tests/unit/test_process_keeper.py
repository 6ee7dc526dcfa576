"""pdserve/cluster/process_keeper.py with real processes, as a Ray actor starts it (in its own
session):
its worker leads its own group, and whatever way the worker ends (SIGKILL, a SIGTERM passed on,
a SIGTERM it ignores) its engine processes go with it."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.integration.processes import alive

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from pdserve.worker import group_reaper
    if sys.argv[2] == "deaf":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    group_reaper.start_for_this_worker()
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(engine.pid, flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(3)
    """
)
KEEPER = "import sys; from pdserve.cluster import process_keeper as k; k.KILL_AFTER_S = 1; "
KEEPER += "sys.exit(k.main(sys.argv[1:]))"


def run_keeper(lifetime_s: float, mode: str = "") -> tuple[subprocess.Popen, int, int]:
    """The keeper (its kill-after cut to 1 s), its worker's pid, the worker's engine's pid."""
    keeper = subprocess.Popen(
        [sys.executable, "-c", KEEPER, sys.executable, "-c", WORKER, str(lifetime_s), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    engine = int(keeper.stdout.readline())
    (worker,) = [
        int(p) for p in Path(f"/proc/{keeper.pid}/task/{keeper.pid}/children").read_text().split()
    ]
    assert os.getpgid(worker) == worker == os.getpgid(engine), "the worker leads its group"
    return keeper, worker, engine


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_a_sigkilled_worker_takes_its_engine_with_it_and_its_code_is_passed_on():
    keeper, worker, engine = run_keeper(120)
    try:
        os.kill(worker, signal.SIGKILL)  # no goodbye: without a reaper the engine is orphaned
        assert keeper.wait(timeout=10) == 128 + signal.SIGKILL
        assert wait_gone([worker, engine]) == [], "the engine outlived its worker"
    finally:
        _end(keeper, worker)


def test_a_worker_that_exits_leaves_nothing_and_its_code_is_passed_on():
    keeper, worker, engine = run_keeper(0.5)
    try:
        assert keeper.wait(timeout=10) == 3
        assert wait_gone([worker, engine]) == []
        assert "exited with code 3" in keeper.stdout.read()
    finally:
        _end(keeper, worker)


def test_a_sigterm_to_the_keeper_is_passed_on_to_the_worker():
    keeper, worker, engine = run_keeper(120)
    try:
        os.killpg(keeper.pid, signal.SIGTERM)  # as the actor's stop does
        assert keeper.wait(timeout=10) == 128 + signal.SIGTERM
        assert wait_gone([worker, engine]) == []
    finally:
        _end(keeper, worker)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace():
    keeper, worker, engine = run_keeper(120, "deaf")
    try:
        sent = time.monotonic()
        os.killpg(keeper.pid, signal.SIGTERM)
        assert keeper.wait(timeout=10) == 128 + signal.SIGKILL
        assert time.monotonic() - sent >= 1.0  # the keeper's kill-after (cut to 1 s): not before
        assert wait_gone([worker, engine]) == []
    finally:
        _end(keeper, worker)


def _end(keeper: subprocess.Popen, worker: int) -> None:
    """Whatever a failed test left: both groups."""
    keeper.stdout.close()
    for group in (keeper.pid, worker):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    keeper.wait(timeout=10)
