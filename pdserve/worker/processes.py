"""The one way pdserve starts, waits for and stops a child process.

Every child runs in its own session, so its process group holds it and whatever it starts (a
worker's vLLM engine core, say); stopping it signals that group by its id, never a name:
SIGTERM, a grace period, then SIGKILL for whatever is left. A child may also get SIGTERM when
its parent dies (Linux parent-death signal), so no engine outlives its launcher. Every wait has
a deadline.
"""

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.worker.root_cause import root_cause

PR_SET_PDEATHSIG = 1
POLL_S = 0.2
FIRST_CHOSEN_PORT = 20000  # free_port draws from here to the ephemeral range's start
NODE_PORTS_START = 30000  # Kubernetes' NodePort range, caught before the socket on a host network
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_random = random.SystemRandom()  # a seeded `random` in one process must not make two draw alike


class ChildError(RuntimeError):
    """A child exited before it was ready, or was not ready by its deadline."""


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port free now, with the `count - 1` ports after it free too (a tensor-parallel decode
    worker's rank r receives KV on port + r). Drawn at random below the kernel's ephemeral
    range: a port is chosen here and bound later, often by another process, and meanwhile any
    socket bound to port 0 (vLLM's, gloo's) could be handed one from that range (seen: a TP-2
    decode worker's second KV receiver failing to bind its port)."""
    first, last = FIRST_CHOSEN_PORT, min(_ephemeral_ports_start(), NODE_PORTS_START) - count
    for _ in range(200):
        port = _random.randint(first, last) if first <= last else _kernel_port(host)
        if all(_is_free(host, port + offset) for offset in range(count)):
            return port
    raise OSError(f"no {count} consecutive free ports on {host}")


def _ephemeral_ports_start() -> int:
    try:
        return int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _kernel_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    command: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    dies_with_parent: bool = True,
    pass_fds: tuple[int, ...] = (),
    cwd: Path | None = None,
) -> subprocess.Popen:
    """Start `command` in its own session, its output appended to `log_path`, in `cwd` (this
    process's directory by default). A service meant to outlive this process (a Ray head or
    Redis that `pdserve up` starts) passes `dies_with_parent=False`; `pass_fds` stay open in
    the child."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent if dies_with_parent else None,
            env=env if env is not None else dict(os.environ),
            pass_fds=pass_fds,
            cwd=cwd,
        )


def wait_until(
    ready: Callable[[], bool],
    process: subprocess.Popen,
    timeout_s: float,
    what: str,
    log_path: Path | None = None,
    progress: Callable[[float], None] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Poll `ready()` until it is true; ChildError (with the log's tail) if the process exits
    first or the deadline passes. `progress(elapsed)` is called every 10 s meanwhile."""
    started = last_report = time.monotonic()
    while not ready():
        if process.poll() is not None:
            raise ChildError(
                f"{what} exited with code {process.returncode}{failure_report(log_path)}"
            )
        now = time.monotonic()
        if now - started > timeout_s:
            raise ChildError(f"{what} not ready after {timeout_s:.0f} s{log_tail(log_path)}")
        if progress is not None and now - last_report >= 10:
            last_report = now
            progress(now - started)
        time.sleep(poll_s)


def failure_report(log_path: Path | None) -> str:
    """Why the child whose log is `log_path` failed: the root cause and where the log is (the
    end of the log when it names no exception)."""
    if log_path is None:
        return ""
    try:
        cause = root_cause(log_path.read_text(errors="replace"))
    except OSError:
        return f" (no log at {log_path})"
    return f": {cause}\n(the whole log: {log_path})" if cause else log_tail(log_path)


def log_tail(log_path: Path | None, lines: int = 30) -> str:
    if log_path is None:
        return ""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return f" (no log at {log_path})"
    return f"; the end of {log_path}:\n" + "\n".join(text.splitlines()[-lines:])


def stop_group(group: int, grace_s: float = 20.0, process: subprocess.Popen | None = None) -> bool:
    """SIGTERM process group `group` (a child started by `spawn` leads its own), wait up to
    `grace_s` for all of it to exit, SIGKILL what is left. True when it stopped in the grace."""
    _signal_group(group, signal.SIGTERM)
    if _wait_gone(group, process, grace_s):
        return True
    _signal_group(group, signal.SIGKILL)
    _wait_gone(group, process, 5.0)
    return False


def stop_leader_first(group: int, grace_s: float = 20.0) -> bool:
    """SIGTERM only the leader of process group `group`, for a leader that stops its own
    children in order (a signal to all of them at once can leave it waiting on them); after
    `grace_s`, SIGKILL to the whole group. True when it stopped in the grace."""
    try:
        os.kill(group, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if _wait_gone(group, None, grace_s):
        return True
    _signal_group(group, signal.SIGKILL)
    _wait_gone(group, None, 5.0)
    return False


def _wait_gone(group: int, process: subprocess.Popen | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _group_alive(group, process):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int, process: subprocess.Popen | None) -> bool:
    """Whether a process of the group is still running (the leader is reaped here if it is our
    child). Zombies do not count: an orphaned member (a tensor-parallel rank whose engine core
    exited first) is PID 1's to reap, which this host's init does 1-2 s later and a container's
    PID 1 may never do, while it has already released everything it held."""
    if process is not None:
        if process.poll() is None and _exists(group):
            return True  # its exit not known yet (a fork server's child: once the server reaps it)
    else:
        try:
            os.waitpid(group, os.WNOHANG)
        except ChildProcessError:
            pass
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return any(_running_in(group, stat) for stat in Path("/proc").glob("[0-9]*/stat"))


def _exists(pid: int) -> bool:
    """A process `pid` exists, a zombie included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _running_in(group: int, stat: Path) -> bool:
    """Whether /proc/PID/stat's process is in process group `group` and not a zombie."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except (OSError, IndexError):
        return False  # gone meanwhile
    state, _parent, process_group = fields[:3]
    return int(process_group) == group and state != "Z"
