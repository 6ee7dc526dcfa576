"""Process-tree queries read from /proc: `ps` output is cut at $COLUMNS where no terminal is."""
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which sits in parentheses and may hold spaces):
    state, ppid, pgrp, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def group_members(group: int) -> list[int]:
    """Live processes in process group `group`."""
    return [pid for pid in _pids()
            if (fields := _stat_fields(pid)) and int(fields[2]) == group and fields[0] != "Z"]


def pids_running(*words: str) -> list[int]:
    """Processes whose command line holds every one of `words` as an argument."""
    return [pid for pid in _pids() if all(word in command_line(pid) for word in words)]


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def children(pid: int) -> list[int]:
    return [child for child in _pids() if parent_of(child) == pid]


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = children(frontier.pop())
        found += kids
        frontier += kids
    return found


def pids_with_environment(variable: str) -> list[int]:
    """Live processes whose environment sets `variable` (children inherit it)."""
    found = []
    for pid in _pids():
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(entry.startswith(variable.encode() + b"=") for entry in environment) and alive(pid):
            found.append(pid)
    return found
