"""Process-tree queries for the tests, through psutil (not `ps`, whose output is cut at
$COLUMNS where there is no terminal)."""

import os

import psutil


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


def worker_pids(server, role: str) -> list[int]:
    """The live workers of `role` that `server` (a `pdserve serve`) started."""
    return [
        child
        for child in children(server.process.pid)
        if alive(child) and any(f'"role":"{role}"' in part for part in command_line(child))
    ]
