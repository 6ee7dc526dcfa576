"""Crash-loop back-off for one worker slot: how long the replica keeper waits, once it has seen
the slot's worker dead, before it starts a replacement.

As Kubernetes' CrashLoopBackOff: the wait doubles with every replacement (FIRST_S up to MAX_S),
and a worker that stayed up STABLE_S before dying resets it. One crash after a long run is
replaced within a second; a worker that cannot start (bad weights, no memory) does not spin
placement groups and 30 s engine loads in a hot loop. Times are `time.monotonic()` seconds,
passed in, so the rule is tested without waiting.
"""

from dataclasses import dataclass

FIRST_S = 1.0
MAX_S = 60.0
STABLE_S = 300.0


@dataclass
class CrashLoopBackoff:
    started_at: float  # when the slot's current worker was started (or first kept)
    delay_s: float = FIRST_S  # the wait before the next replacement
    dead_since: float | None = None  # when its worker was first seen dead; None: not seen dead

    def due(self, now: float) -> bool:
        """The worker is dead: True once its replacement may start."""
        if self.dead_since is None:
            self.dead_since = now
            if now - self.started_at >= STABLE_S:  # it ran long enough: not a crash loop
                self.delay_s = FIRST_S
        return now >= self.dead_since + self.delay_s

    def replaced(self, now: float) -> None:
        """A replacement was started (or tried) now: the next one waits twice as long."""
        self.started_at = now
        self.dead_since = None
        self.delay_s = min(MAX_S, self.delay_s * 2)

    def wait_left(self, now: float) -> float:
        """Seconds until a replacement is due; 0 when the worker is not known dead."""
        if self.dead_since is None:
            return 0.0
        return max(0.0, self.dead_since + self.delay_s - now)
