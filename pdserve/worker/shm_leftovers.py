"""The shared-memory files a worker's vLLM engine leaves in /dev/shm when it stops.

vLLM's multiprocessing executor (tensor parallelism, and vLLM's own server on CPU) keeps its
message queues in `psm_*` segments (160 MiB each) and its CPU tensor-parallel communicator in
`vllm_dist_*` files, and removes them only when every one of its processes exits cleanly: a stop
of the worker left them behind, and /dev/shm is memory (in a pod, a volume that outlives the
container). Before its engine stops, the worker notes its engine's processes and the files
they map; once those processes have exited, it removes the files that no process maps any more.
That is all it removes: what it can show was its engine's, never a file a live process uses.
"""

import contextlib
import os
import time
from pathlib import Path

import psutil

SHM = "/dev/shm/"
EXIT_WAIT_S = 5.0  # how long the engine's processes get to exit after its shutdown returned
POLL_S = 0.05
REAPER_MODULE = "pdserve.worker.group_reaper"
VLLM_PREFIXES = ("psm_", "vllm_dist_")  # its message queues, its CPU communicator's files
UNMAPPED_S = 1.0  # how long a new file no process maps waits before it counts as left over


def mapped_by(pids: list[int]) -> set[Path]:
    """The /dev/shm files that the processes `pids` map (those gone meanwhile are skipped)."""
    files = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(SHM) and not fields[5].endswith(")"):
                files.add(Path(fields[5]))  # "(deleted)": unlinked already
    return files


def engine_processes() -> list[psutil.Process]:
    """This worker's engine processes now: its descendants but its group reaper (which stays
    until the worker itself exits)."""
    return [
        process
        for process in psutil.Process().children(recursive=True)
        if REAPER_MODULE not in " ".join(_command_line(process))
    ]


def remove_once_gone(
    processes: list[psutil.Process], files: set[Path], timeout_s: float = EXIT_WAIT_S
) -> list[Path]:
    """Once `processes` (the engine's, noted before it stopped) have exited, remove those of
    `files` that exist and that no process maps; returns them. vLLM's engine core returns from
    its shutdown before its ranks have gone, and a rank still maps its queues: processes left
    after `timeout_s` are killed, as the worker's group reaper would kill them anyway."""
    _stop(processes, timeout_s)
    return _remove(files - mapped_by(psutil.pids()))


def vllm_files() -> set[Path]:
    """vLLM's files in /dev/shm now (message queues, communicator files) that this user owns."""
    uid = os.getuid()
    files = set()
    for path in Path(SHM).iterdir():
        with contextlib.suppress(FileNotFoundError):
            if path.name.startswith(VLLM_PREFIXES) and path.stat().st_uid == uid:
                files.add(path)
    return files


def remove_after_failed_start(
    processes: list[psutil.Process], before: set[Path], timeout_s: float = EXIT_WAIT_S
) -> list[Path]:
    """After this worker's engine failed to start: once `processes` (its engine's processes
    left, engine_processes()) have exited or are killed after `timeout_s`, remove the
    vLLM files made since `before` (vllm_files() before the start) that no process maps; returns
    them. A start can fail before the worker could note which files its engine mapped (a rank
    dies loading the weights, its communicator files made), so what is new is the candidate; a
    file another engine of this host makes meanwhile is mapped by it within microseconds of
    its creation, so a candidate is removed only once no process has mapped it for UNMAPPED_S."""
    _stop(processes, timeout_s)
    candidates = vllm_files() - before
    while candidates:
        candidates -= mapped_by(psutil.pids())
        young = [path for path in candidates if _age_s(path) < UNMAPPED_S]
        if not young:
            break
        time.sleep(UNMAPPED_S - min(_age_s(path) for path in young))
    return _remove(candidates)


def _remove(files: set[Path]) -> list[Path]:
    """Unlink `files`; those that existed, in order."""
    removed = []
    for path in sorted(files):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_ctime
    except FileNotFoundError:
        return UNMAPPED_S


def _stop(processes: list[psutil.Process], timeout_s: float) -> None:
    """Wait up to `timeout_s` for `processes` to exit; kill those left, and wait for them."""
    alive = _wait_exited(processes, timeout_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    _wait_exited(alive, timeout_s)


def _wait_exited(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of `processes` that have not exited within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    alive = list(processes)
    while alive := [process for process in alive if not _exited(process)]:
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return alive


def _exited(process: psutil.Process) -> bool:
    """Gone, or a zombie: its memory and mappings went with its exit, only its parent's wait is
    left, and an orphaned rank's parent is PID 1, which reaps late (this host's init: 1-2 s) or,
    in a container whose PID 1 is pdserve itself, never (psutil's wait_procs waited for it: a
    TP worker's stop took the reaping's delay, or both 5 s waits). This process's own child is
    reaped here."""
    try:
        process.wait(timeout=0)
        return True
    except psutil.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    return True


def _command_line(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
