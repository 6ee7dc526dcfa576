"""The shared-memory files a worker's vLLM engine leaves in /dev/shm when it stops.

vLLM's multiprocessing executor (tensor parallelism, and vLLM's own server on CPU) keeps its
message queues in `psm_*` segments (160 MiB each) and its CPU tensor-parallel communicator in
`vllm_dist_*` files, and removes them only when every one of its processes exits cleanly: a stop
of the worker left them behind, and /dev/shm is memory (in a pod, a volume that outlives the
container). Before its engine stops, the worker notes which of them its own engine processes
map; after, it removes those that no process maps any more. That is all it removes: what it can
show was its engine's, never a file another live process uses.
"""

import contextlib
from pathlib import Path

import psutil

SHM = "/dev/shm/"


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


def engine_files() -> set[Path]:
    """The /dev/shm files this process's descendants (its engine's processes) map now."""
    return mapped_by([child.pid for child in psutil.Process().children(recursive=True)])


def remove_unmapped(files: set[Path]) -> list[Path]:
    """Remove those of `files` that exist and that no process maps; returns them."""
    still_mapped = mapped_by(psutil.pids())
    removed = []
    for path in sorted(files - still_mapped):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed
