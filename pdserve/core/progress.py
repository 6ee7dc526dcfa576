"""Progress of long work (a plan's simulations, a benchmark's requests) on stderr: one line
redrawn in place on a terminal; elsewhere (a log file, CI, a pipe) one line per tenth of the work
and one at the end, so the log reads line by line instead of as every update glued into one line
by carriage returns."""

import sys
from typing import TextIO


class Progress:
    """`done`/`total` of some work, with an optional note (e.g. "2 failed") after the count."""

    def __init__(self, total: int, what: str, stream: TextIO | None = None, enabled: bool = True):
        self.total = total
        self.what = what  # e.g. "configurations simulated"
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.terminal = self.stream.isatty()
        self.done = 0
        self.note = ""
        self._tenths_shown = 0
        self._shown: str | None = None  # the last line written
        self._open = False  # a terminal line drawn and not yet ended

    def line(self) -> str:
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        note = f", {self.note}" if self.note else ""
        return f"{self.done}/{self.total} {self.what}{share}{note}"

    def advance(self, count: int = 1, note: str | None = None) -> None:
        self.done += count
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        if self.terminal:
            self._write("\r" + self.line())
            self._open = True
            if self.done >= self.total:
                self.close()
            return
        tenths = 10 * self.done // self.total if self.total else 10
        if tenths > self._tenths_shown:
            self._tenths_shown = tenths
            self._write(self.line() + "\n")

    def at(self, done: int, total: int) -> None:
        """A callback's form: `done` of `total` (which may be known only once the work starts)."""
        self.total = total
        self.advance(done - self.done)

    def close(self) -> None:
        """End the output: the terminal's line, or, elsewhere, the count where the work stopped
        (a deadline may end it before `total`) when that was not the last line written."""
        if not self.enabled:
            return
        if self._open:
            self._write("\n")
            self._open = False
        elif not self.terminal and self._shown != self.line() + "\n":
            self._write(self.line() + "\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
        if text != "\n":
            self._shown = text
