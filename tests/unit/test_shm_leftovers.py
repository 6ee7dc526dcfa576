"""The worker's clean-up of what its engine leaves in /dev/shm (pdserve/worker/shm_leftovers.py),
with real processes that map real /dev/shm files: a stand-in for an engine process (a child of
this test) and one for an unrelated process."""

import signal
import subprocess
import sys
import uuid
from pathlib import Path

from pdserve.worker.shm_leftovers import engine_files, mapped_by, remove_unmapped
from tests.waiting import wait_for

# Maps a new /dev/shm file of one page, says so, then sleeps until killed; never unlinks it.
MAPPER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, mmap.PAGESIZE)
memory = mmap.mmap(fd, mmap.PAGESIZE)
print("mapped", flush=True)
time.sleep(120)
"""


def mapping(path: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "mapped\n"
    return process


def shm_file() -> Path:
    return Path(f"/dev/shm/pdserve-test-{uuid.uuid4().hex}")


def test_a_file_the_engine_mapped_is_removed_once_no_process_maps_it():
    path = shm_file()
    engine = mapping(path)  # a descendant of this process, as an engine is of its worker
    try:
        noted = engine_files()
        assert path in noted
        assert remove_unmapped(noted) == []  # still mapped: kept
        assert path.exists()
        engine.send_signal(signal.SIGKILL)  # killed: it cannot remove the file itself
        engine.wait(timeout=10)
        wait_for(lambda: path not in mapped_by([engine.pid]), 10, "the mapping gone")
        assert path in remove_unmapped(noted)
        assert not path.exists()
    finally:
        engine.kill()
        engine.wait(timeout=10)
        path.unlink(missing_ok=True)


def test_a_file_another_live_process_maps_is_never_removed():
    path = shm_file()
    other = mapping(path)
    try:
        assert remove_unmapped({path}) == []
        assert path.exists()
    finally:
        other.kill()
        other.wait(timeout=10)
        path.unlink(missing_ok=True)


def test_files_gone_or_unlinked_already_are_skipped():
    path = shm_file()
    engine = mapping(path)
    try:
        path.unlink()  # the engine removed it itself; its mapping shows "(deleted)"
        assert path not in engine_files()
        assert remove_unmapped({path}) == []
    finally:
        engine.kill()
        engine.wait(timeout=10)
