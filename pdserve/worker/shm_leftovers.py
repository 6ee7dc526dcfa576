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
import time
from pathlib import Path

import psutil

SHM = "/dev/shm/"
EXIT_WAIT_S = 5.0  # how long the engine's processes get to exit after its shutdown returned
POLL_S = 0.05
REAPER_MODULE = "pdserve.worker.group_reaper"


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
    alive = _wait_exited(processes, timeout_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    _wait_exited(alive, timeout_s)
    still_mapped = mapped_by(psutil.pids())
    removed = []
    for path in sorted(files - still_mapped):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


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
