"""Process-tree queries for the tests, through psutil (not `ps`, whose output is cut at
$COLUMNS where there is no terminal)."""

import json
import os
import re
import time
from pathlib import Path

import psutil

from pdserve.worker.rpc_folder import PREFIX
from pdserve.worker.shm_leftovers import mapped_by

SHM = Path("/dev/shm")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(group: int) -> list[int]:
    """Live processes in process group `group`."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == group and alive(process.pid):
                members.append(process.pid)
        except ProcessLookupError:
            pass
    return members


def command_line(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def kv_pool_address(pid: int) -> str:
    """The KV pool worker `pid` joins, as its command line's settings say."""
    line = command_line(pid)
    return json.loads(line[line.index("--settings-json") + 1])["kv_pool_address"]


def pids_running(*words: str) -> list[int]:
    """Processes whose command line holds every one of `words` as an argument."""
    return [p.pid for p in psutil.process_iter() if all(w in command_line(p.pid) for w in words)]


def children(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pids_with_environment(variable: str) -> list[int]:
    """Live processes whose environment sets `variable` (children inherit it)."""
    found = []
    for process in psutil.process_iter():
        try:
            if variable in process.environ() and alive(process.pid):
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def worker_pids(server, role: str | None = None) -> list[int]:
    """The live workers (of `role`, or all) that `server` (a `pdserve serve`) started: children
    of its fork server (pdserve/worker/fork_server.py)."""
    return [
        pid
        for pid in descendants(server.process.pid)
        if alive(pid)
        and "--settings-json" in (words := command_line(pid))
        and (role is None or any(f'"role":"{role}"' in word for word in words))
    ]


def shm_left_since(before: set[Path], settle_s: float = 10.0) -> list[str]:
    """Files in /dev/shm that are new since `before` and that no process maps (the other
    stream's engines map theirs while they run), once `settle_s` has passed or none is left."""
    deadline = time.monotonic() + settle_s
    while True:
        left = set(SHM.iterdir()) - before - mapped_by(psutil.pids())
        if not left or time.monotonic() > deadline:
            return sorted(path.name for path in left if path.exists())
        time.sleep(0.2)


def rpc_folders_named_in(log_dir: Path) -> set[Path]:
    """The folders of vLLM's IPC sockets (pdserve/worker/rpc_folder.py) that the workers whose
    logs are in `log_dir` made, as they log them at start."""
    named = re.compile(rf"(/\S*/{PREFIX}\w+)")
    return {
        Path(folder)
        for log in log_dir.glob("*.log")
        for folder in named.findall(log.read_text(errors="replace"))
    }
