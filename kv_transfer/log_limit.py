"""Log lines that a peer can cause before it has proved anything (a refused hello or call, a
stream with no hello, a connection from another user): at most one per kind every
`interval_s`, the next one saying how many were left out, so an unauthenticated peer cannot
flood the log (or the disk, or the log pipeline) at the rate it can open connections.

Plain Python: the worker's gRPC gate (pdserve/worker/secret_check.py) uses it too."""

import logging
import threading
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0


class LogLimit:
    """`log(level, kind, message, *args)`: logged unless a line of the same `kind` (a fixed
    string chosen by the caller, never a peer's value: the kinds stay few) was logged less than
    `interval_s` ago; then only counted."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self.lock = threading.Lock()
        self.kinds: dict[str, tuple[float, int]] = {}  # kind -> (last logged, left out since)

    def log(self, level: int, kind: str, message: str, *args) -> bool:
        """Whether the line was logged."""
        now = self.clock()
        with self.lock:
            last, left_out = self.kinds.get(kind, (None, 0))
            if last is not None and now - last < self.interval_s:
                self.kinds[kind] = (last, left_out + 1)
                return False
            self.kinds[kind] = (now, 0)
        if left_out:
            message += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, left_out, now - last)
        self.logger.log(level, message, *args)
        return True

    def error(self, kind: str, message: str, *args) -> bool:
        return self.log(logging.ERROR, kind, message, *args)

    def warning(self, kind: str, message: str, *args) -> bool:
        return self.log(logging.WARNING, kind, message, *args)
