"""Where a system's CPU went over a span of a benchmark: the CPU seconds of each process the
benchmark started (a system under test runs as this process's descendants), summed by what the
process is. On a host of a few cores every second a router, a worker's gRPC server or a KV pool
store spends is one its engine lacks: against plain vLLM's two processes (its API server and its
engine core) this shows where pdserve's extra goes.

A process that exits within the span loses what it spent in it (none of a running system's do).
"""

from collections import defaultdict

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

Sample = dict[int, tuple[str, float]]  # pid -> (what it is, CPU seconds so far)


def sample() -> Sample:
    """Every descendant's CPU seconds (user and system, all its threads) now."""
    taken: Sample = {}
    for process in psutil.Process().children(recursive=True):
        try:
            with process.oneshot():
                times = process.cpu_times()
                taken[process.pid] = (role_of(process), times.user + times.system)
        except psutil.Error:  # gone since the listing
            continue
    return taken


def spent(before: Sample, after: Sample) -> dict[str, float]:
    """CPU seconds spent between the samples, by what the process is, most first."""
    totals: dict[str, float] = defaultdict(float)
    for pid, (role, seconds) in after.items():
        totals[role] += seconds - before.get(pid, (role, 0.0))[1]
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


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
