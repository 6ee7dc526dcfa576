"""Worker processes forked from one that has already imported vLLM.

A worker spends ~8 s of a core importing torch and vLLM before its engine starts, most of a
small model's start. `pdserve serve` starts one fork server beside its workers: the server
imports what a worker imports, once, then forks each worker from itself, so a cluster of N
workers pays for the imports once instead of N times (and a restart skips them).

A forked worker is what `processes.spawn` would have started: its own session (it leads its
process group), its output in its log, exactly the environment it was given, the same
arguments (`pdserve worker ...`, shown in process listings), and a parent-death signal (its
parent is the server, which gets one from `serve`). The server reaps its children and reports
each exit code to the launcher, so `ForkedProcess` answers as a `subprocess.Popen` does.

What the child cannot get from its environment, because the server loaded torch (and with it
OpenMP) before the child existed, it sets itself: its thread count, and its cores when
`serve --cpu-binding split` gave it some (`apply_cpu_share`). CUDA must not be initialised in
the server (a forked child could not use it): it is checked once the imports are done.

Protocol (pdserve/worker/fork_messages.py, JSON lines over two pipes): the server says Ready
once, the launcher sends a Fork per child, the server answers Forked or ForkFailed, and later
an Exited for each child.
"""

import importlib
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.worker.fork_messages import (
    Exited,
    Fork,
    Forked,
    ForkFailed,
    ForkMessageError,
    Ready,
    decode,
    encode,
)
from pdserve.worker.processes import spawn

# What a worker imports before its engine starts (pdserve/worker/command.py, engine.py), on any
# platform: a platform's own modules (vLLM's CPU or GPU worker) load after the fork.
PRELOAD = (
    "pdserve.cli",
    "pdserve.worker.command",
    "pdserve.worker.service",
    "pdserve.worker.engine",
    "vllm.engine.arg_utils",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.core",
)
READY_TIMEOUT_S = 300.0  # the imports take ~8 s of a core; a loaded host stretches that
REPLY_TIMEOUT_S = 30.0  # a fork answers in milliseconds
REAP_POLL_S = 0.1

log = logging.getLogger("pdserve.worker")


class ForkServerError(RuntimeError):
    """The fork server could not start, or could not start a child."""


class ForkedProcess:
    """A child of the fork server, answering as much of `subprocess.Popen` as launchers use."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the server (`python -m pdserve.worker.fork_server`), asks it
    for children, and learns their exits. `close()` ends the server (and with it, through
    their parent-death signal, any child still running)."""

    def __init__(self, log_path: Path, preload: tuple[str, ...] = PRELOAD):
        requests_read, self._requests = os.pipe()
        replies, replies_write = os.pipe()
        command = [sys.executable, "-m", __name__, str(requests_read), str(replies_write)]
        command.append(",".join(preload))
        self.process = spawn(command, log_path, pass_fds=(requests_read, replies_write))
        os.close(requests_read)
        os.close(replies_write)
        self._log_path = log_path
        self._spawning = threading.Lock()  # one request at a time: a reply is its request's
        self._children_lock = threading.Lock()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits read before `spawn` recorded the child
        self._reply: list[Ready | Forked | ForkFailed] = []
        self._replied = threading.Condition()
        self._reader = threading.Thread(target=self._read_replies, args=(replies,), daemon=True)
        self._reader.start()
        self._await_reply(READY_TIMEOUT_S, "ready")

    def spawn(self, command: list[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        """Start `command` (`python -m MODULE ARGS...`) as a forked child that runs MODULE as
        its main module; see the module's docstring."""
        if len(command) < 3 or command[1] != "-m":
            raise ValueError(f"a forked child runs a module (python -m ...), not {command}")
        module, argv = command[2], command[3:]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        request = Fork(module, tuple(argv), dict(env), str(log_path), " ".join(command))
        with self._spawning:
            os.write(self._requests, encode(request))
            child = ForkedProcess(self._await_reply(REPLY_TIMEOUT_S, "fork").pid)
        with self._children_lock:
            if child.pid in self._early_exits:
                child._set_exit(self._early_exits.pop(child.pid))
            else:
                self._children[child.pid] = child
        return child

    def close(self) -> None:
        """End the server: it exits once it has read that its requests ended."""
        os.close(self._requests)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._reader.join(timeout=10)

    def _await_reply(self, timeout_s: float, what: str) -> Ready | Forked:
        deadline = time.monotonic() + timeout_s
        with self._replied:
            while not self._reply:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise ForkServerError(
                        f"fork server: no {what} reply (exit code {self.process.poll()}); "
                        f"see {self._log_path}"
                    )
                self._replied.wait(min(left, 1.0))
            reply = self._reply.pop(0)
        if isinstance(reply, ForkFailed):
            raise ForkServerError(f"fork server: {reply.error}")
        return reply

    def _read_replies(self, fd: int) -> None:
        with os.fdopen(fd, "r") as replies:
            for line in replies:
                try:
                    message = decode(line, (Ready, Forked, ForkFailed, Exited))
                except ForkMessageError as error:  # a request waiting on it times out
                    log.error("fork server: %s", error)
                    continue
                if isinstance(message, Exited):
                    self._exited(message.pid, message.code)
                    continue
                with self._replied:
                    self._reply.append(message)
                    self._replied.notify_all()
        # The server is gone: its children got their parent-death signal.
        with self._children_lock:
            left = list(self._children)
        for pid in left:
            self._exited(pid, -signal.SIGTERM)

    def _exited(self, pid: int, code: int) -> None:
        with self._children_lock:
            child = self._children.pop(pid, None)
            if child is None:
                self._early_exits[pid] = code
        if child is not None:
            child._set_exit(code)


def apply_cpu_share() -> None:
    """In a forked worker: the thread count and cores its environment asks for, which OpenMP
    read from the server's environment when torch loaded there. A single core list in
    VLLM_CPU_OMP_THREADS_BIND (`serve --cpu-binding split`) pins the process to those cores,
    as OMP_PROC_BIND pins a freshly started worker's threads. Without torch loaded in the server
    the child's own import reads its environment: nothing to do."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    from pdserve.worker.engine_process import OMP_BIND_ENV, core_ids

    bind = os.environ.get(OMP_BIND_ENV, "nobind")
    if bind not in ("nobind", "auto") and "|" not in bind:
        cores = core_ids(bind)
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    elif threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))


def _serve(requests_fd: int, replies_fd: int, preload: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches serve, which stops us
    for module in preload:
        importlib.import_module(module)
    import torch

    if torch.cuda.is_initialized():
        raise ForkServerError("the imports initialised CUDA: a forked worker could not use it")
    _reply(replies_fd, Ready())
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([requests_fd], [], [], REAP_POLL_S)
        for pid, code in _reap(children):
            _reply(replies_fd, Exited(pid, code))
        if not readable:
            continue
        chunk = os.read(requests_fd, 1 << 20)
        if not chunk:
            return 0  # the launcher closed its end
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = decode(line, Fork)
            except ForkMessageError as error:
                _reply(replies_fd, ForkFailed(str(error)))
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as error:
                _reply(replies_fd, ForkFailed(f"fork failed: {error}"))
                continue
            if pid == 0:
                _become_worker(request, (requests_fd, replies_fd))
            children.add(pid)
            _reply(replies_fd, Forked(pid))


def _reply(fd: int, message: Ready | Forked | ForkFailed | Exited) -> None:
    os.write(fd, encode(message))


def _reap(children: set[int]) -> list[tuple[int, int]]:
    exits = []
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            exits.append((pid, os.waitstatus_to_exitcode(status)))
    return exits


def _become_worker(request: Fork, server_fds: tuple[int, ...]) -> None:
    """In the child: become the worker the request describes; never returns."""
    code = 1
    try:
        server = os.getppid()
        import setproctitle  # first: it needs the environment block the server started with

        setproctitle.setproctitle(request.title)
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        output = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        os.close(null)
        os.environ.clear()
        os.environ.update(request.env)
        from pdserve.worker.processes import die_with_parent

        die_with_parent()
        if os.getppid() != server:  # the server died before the signal was armed
            os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        apply_cpu_share()
        sys.argv = [request.module, *request.argv]
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    code = _serve(int(sys.argv[1]), int(sys.argv[2]), list(filter(None, sys.argv[3].split(","))))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing to clean up, and tearing down vLLM's imports took seconds
