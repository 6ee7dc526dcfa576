"""The root cause of a child's failure, read from its log: what a user needs on the console
when a worker dies, without opening the log.

A vLLM engine that fails to start ends its log with wrappers ("Engine core initialization
failed. See root cause above.", "WorkerProc initialization failed due to an exception in a
background process") while the real exception (a refused model, a missing weight) came first,
often from another process (a tensor-parallel rank) whose lines carry a prefix such as
`(Worker_TP0 pid=1) ERROR 12-05 22:00:55 [file.py:953] `. The first exception of the log that
is not such a wrapper is the root cause.
"""

import re

# vLLM's per-process log prefix: "(EngineCore pid=7) ERROR 12-05 22:00:55 [core.py:1510] ".
_PREFIX = re.compile(r"^\([\w.-]+ pid=\d+\) (?:\w+ \d\d-\d\d [\d:.]+ \[[^\]]*\] )?")
# "ValueError: ...", "kv_transfer.kv_layout.LayoutError: ...", "KeyError".
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?:: (.*))?$")
_WRAPPERS = (
    "see root cause above",
    "see stack trace for root cause",
    "engine failed to start",
)


def root_cause(log: str) -> str | None:
    """The first exception line (`Class: message`) that ends a traceback in `log` and is not a
    wrapper of another; the last such line when every one is a wrapper; None without any."""
    found = []
    in_traceback = False
    for raw in log.splitlines():
        line = _PREFIX.sub("", raw).rstrip()
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if not in_traceback or not line or line[0].isspace():
            continue
        in_traceback = False
        if _EXCEPTION.match(line):
            found.append(line)
    for line in found:
        if not any(wrapper in line.lower() for wrapper in _WRAPPERS):
            return line
    return found[-1] if found else None
