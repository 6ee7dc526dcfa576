"""Process-tree queries read from /proc: `ps` output is cut at $COLUMNS where no terminal is."""
from pathlib import Path


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name sits in parentheses and may hold spaces: fields start after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def children(pid: int) -> list[int]:
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [child for child in pids if parent_of(child) == pid]


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        kids = children(frontier.pop())
        found += kids
        frontier += kids
    return found
