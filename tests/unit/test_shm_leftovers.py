"""The worker's clean-up of what its engine leaves in /dev/shm (pdserve/worker/shm_leftovers.py),
with real processes that map real /dev/shm files: a stand-in for an engine process (a child of
this test) and one for an unrelated process."""

import contextlib
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from pdserve.worker.shm_leftovers import (
    engine_processes,
    mapped_by,
    remove_after_failed_start,
    remove_once_gone,
    vllm_files,
)

# Maps a new /dev/shm file of one page, says so, then sleeps until killed; never unlinks it.
MAPPER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, mmap.PAGESIZE)
memory = mmap.mmap(fd, mmap.PAGESIZE)
print("mapped", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def mapping_process(prefix: str = "pdserve-test-"):
    """A process that maps a new /dev/shm file named `prefix`...; yields (process, path).
    Killed, and the file removed, on the way out."""
    path = Path(f"/dev/shm/{prefix}{uuid.uuid4().hex}")
    process = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "mapped\n"
        yield process, path
    finally:
        process.kill()
        process.wait(timeout=10)
        path.unlink(missing_ok=True)


def noted(engine: subprocess.Popen):
    """What the worker notes before its engine stops: the engine's processes, the files they
    map."""
    processes = engine_processes()
    assert engine.pid in [process.pid for process in processes]
    return processes, mapped_by([process.pid for process in processes])


def test_a_file_the_engine_mapped_is_removed_once_its_processes_have_exited():
    with mapping_process() as (engine, path):  # a descendant, as an engine is of its worker
        processes, files = noted(engine)
        assert path in files
        engine.send_signal(signal.SIGKILL)  # killed: it cannot remove the file itself
        assert path in remove_once_gone(processes, files)
        assert not path.exists()


def test_an_engine_process_still_there_after_the_wait_is_killed_and_its_file_removed():
    with mapping_process() as (engine, path):
        processes, files = noted(engine)
        assert remove_once_gone(processes, files, timeout_s=0.5) == [path]
        assert not psutil.pid_exists(engine.pid)  # killed (and reaped) by the wait


def test_a_file_another_live_process_maps_is_never_removed():
    with mapping_process() as (_, path):
        assert remove_once_gone([], {path}) == []
        assert path.exists()


def test_files_unlinked_already_are_skipped():
    with mapping_process() as (engine, path):
        path.unlink()  # the engine removed it itself; its mapping shows "(deleted)"
        assert path not in noted(engine)[1]
        assert remove_once_gone([], {path}) == []


# Forks a child that maps a new /dev/shm file and exits; waits for its exit without reaping it
# (a zombie, as a rank orphaned to a PID 1 that never reaps is), says its pid, sleeps until killed.
ZOMBIE_MAKER = """
import mmap, os, sys, time
child = os.fork()
if child == 0:
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, mmap.PAGESIZE)
    memory = mmap.mmap(fd, mmap.PAGESIZE)
    os._exit(0)
os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
print(child, flush=True)
time.sleep(120)
"""


def test_an_engine_process_left_a_zombie_by_a_parent_that_never_reaps_counts_as_exited():
    path = Path(f"/dev/shm/pdserve-test-{uuid.uuid4().hex}")
    parent = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_MAKER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        zombie = psutil.Process(int(parent.stdout.readline()))
        assert zombie.status() == psutil.STATUS_ZOMBIE
        began = time.monotonic()
        assert remove_once_gone([zombie], {path}, timeout_s=30) == [path]
        assert time.monotonic() - began < 10  # not the 30 s wait for a reaping that never comes
    finally:
        parent.kill()
        parent.wait(timeout=10)
        path.unlink(missing_ok=True)


def test_a_failed_start_leaves_none_of_the_vllm_files_made_since_it_began():
    """A TP rank that died loading its weights left its communicator's files: new since the
    start, mapped by no process now. Files older than the start, and a new one a live process
    maps (another engine of the host), stay."""
    older = Path(f"/dev/shm/vllm_dist_pdserve-test-{uuid.uuid4().hex}")
    older.write_bytes(b"x")
    try:
        before = vllm_files()
        assert older in before
        with mapping_process("vllm_dist_pdserve-test-") as (dead_rank, left):
            with mapping_process("psm_pdserve-test-") as (_, in_use):
                rank = psutil.Process(dead_rank.pid)
                dead_rank.send_signal(signal.SIGKILL)
                assert remove_after_failed_start([rank], before, timeout_s=5) == [left]
                assert not left.exists()
                assert in_use.exists() and older.exists()
    finally:
        older.unlink(missing_ok=True)
