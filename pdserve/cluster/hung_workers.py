"""Which kept workers the replica keeper replaces although their process still runs: one that
never became ready, and one that stopped answering.

A worker is in the registry while it is ready and heartbeating (pdserve/worker/membership.py:
its record expires two heartbeats after the last). So a worker whose process runs but that is
not in the registry READY_DEADLINE_S after its start never became ready (an engine load that
hangs), and one that was in it and has been out of it SILENT_S is hung (SIGSTOP, a blocked event
loop, a wedged device): both are replaced as a dead one is. A pass that cannot read the registry
judges no one (Redis away is not every worker hung). Times are `time.monotonic()` seconds,
passed in, so the rule is tested without waiting.
"""

READY_DEADLINE_S = 600.0  # as long as `pdserve up` waits for a worker to join
SILENT_S = 30.0  # out of the registry this long, its process running: hung


def why_hung(started_at: float, last_listed: float | None, now: float) -> str | None:
    """Why the worker started at `started_at` (its process still running), last seen in the
    registry at `last_listed` (None: not since it started), should be replaced now; None when it
    should not."""
    if last_listed is None:
        if now - started_at > READY_DEADLINE_S:
            return f"not ready {now - started_at:.0f} s after its start"
        return None
    if now - last_listed > SILENT_S:
        return f"out of the registry for {now - last_listed:.0f} s, its process running (hung)"
    return None
