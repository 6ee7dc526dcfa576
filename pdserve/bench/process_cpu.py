"""Where a system's CPU went over a span of a benchmark: the CPU seconds of each process the
benchmark started (a system under test runs as this process's descendants), summed by what the
process is. On a host of a few cores every second a router, a worker's gRPC server or a KV pool
store spends is one its engine lacks: against plain vLLM's two processes (its API server and its
engine core) this shows where pdserve's extra goes.

Beside the CPU, each kind's context switches over the span, summed over its threads: voluntary
(a thread waited and was woken: a front's wake-ups) and involuntary (a thread was preempted while
it could run: an engine core's OpenMP threads spin between steps, so every process waking on its
cores preempts one of them, and a forward pass's threads wait at each barrier for a preempted one).

A process that exits within the span loses what it spent in it (none of a running system's do).
"""

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psutil

# What a process is, by a word of its command line (pdserve's processes run as `python -m ...`,
# vLLM's engine core renames itself).
ROLES = (
    ("VLLM::EngineCore", "engine core"),
    ("VLLM::Worker", "engine rank"),
    ("pdserve.worker.fork_server", "fork server"),
    ("pdserve.worker.group_reaper", "group reaper"),
    ("kv_transfer.pool.store", "KV pool store"),
    ("vllm.entrypoints.openai.api_server", "vLLM api_server"),
    ("vllm_pd_proxy.py", "vLLM P/D proxy"),
    ("pdserve.cli serve", "pdserve serve (router)"),
    ("pdserve.cli router", "router"),
)


@dataclass(frozen=True)
class Usage:
    """One process so far: CPU seconds (user and system) and context switches, all its threads."""

    role: str  # what it is
    seconds: float
    voluntary: int = 0
    involuntary: int = 0


Sample = dict[int, Usage]  # pid -> its usage so far


def sample() -> Sample:
    """Every descendant's usage now."""
    taken: Sample = {}
    for process in psutil.Process().children(recursive=True):
        try:
            with process.oneshot():
                times = process.cpu_times()
                role = role_of(process)
            voluntary, involuntary = context_switches(process.pid)
        except (psutil.Error, OSError):  # gone since the listing
            continue
        taken[process.pid] = Usage(role, times.user + times.system, voluntary, involuntary)
    return taken


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of `pid` so far (a process's own
    status counts its first thread only)."""
    voluntary = involuntary = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # the thread ended since the listing
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def spent(before: Sample, after: Sample) -> dict[str, float]:
    """CPU seconds spent between the samples, by what the process is, most first."""
    totals = _between(before, after, lambda usage: usage.seconds)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def switches(before: Sample, after: Sample) -> dict[str, tuple[int, int]]:
    """(voluntary, involuntary) context switches between the samples, by what the process is."""
    voluntary = _between(before, after, lambda usage: usage.voluntary)
    involuntary = _between(before, after, lambda usage: usage.involuntary)
    return {role: (voluntary[role], involuntary[role]) for role in voluntary}


def _between(before: Sample, after: Sample, figure) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(int)
    for pid, usage in after.items():
        earlier = before.get(pid)
        totals[usage.role] += figure(usage) - (figure(earlier) if earlier is not None else 0)
    return totals


def role_of(process: psutil.Process) -> str:
    """What `process` is: a known word of its command line (an engine's processes named after
    the process that started them, a pdserve worker by its role), else its name."""
    line = " ".join(process.cmdline())
    role = next((name for word, name in ROLES if word in line), None)
    if role in ("engine core", "engine rank"):
        parent = process.parent()
        return f"{role_of(parent)}: {role}" if parent is not None else role
    if role is not None:
        return role
    if "pdserve.cli worker" in line:
        words = line.split()
        kind = words[words.index("--role") + 1] if "--role" in words else "worker"
        return f"{kind} worker"
    return process.name()
