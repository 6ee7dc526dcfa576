"""pdserve/bench/process_cpu.py with real processes: what each is, named from its command line
(an engine core after the worker that started it), and the CPU it spent and the times it was
woken between two samples."""

import os
import subprocess
import sys
import textwrap
import time

import psutil

from pdserve.bench import process_cpu

# A stand-in for a decode worker (its command line names it so) whose child renames itself as
# vLLM's engine core does and spins for a while (its script comes in the environment: in the
# worker's command line its title would name the worker an engine core); the worker sleeps a
# millisecond at a time in a thread of its own (woken ~1,000 times a second).
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, threading, time
    engine = subprocess.Popen([sys.executable, "-c", os.environ["ENGINE_CORE"]])
    def nap():
        end = time.monotonic() + 30
        while time.monotonic() < end:
            time.sleep(0.001)
    threading.Thread(target=nap).start()
    """
)
ENGINE = "decode worker: engine core"
ENGINE_CORE = textwrap.dedent(
    """
    import time, setproctitle
    setproctitle.setproctitle("VLLM::EngineCore")
    end = time.monotonic() + 30
    while time.monotonic() < end:
        pass
    """
)


def test_each_process_is_named_by_what_it_is_and_charged_its_cpu():
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, "pdserve.cli worker", "--role", "decode"],
        env={**os.environ, "ENGINE_CORE": ENGINE_CORE},
    )
    try:
        deadline = time.monotonic() + 20
        before = process_cpu.sample()
        while ENGINE not in {usage.role for usage in before.values()}:
            assert time.monotonic() < deadline, f"no engine core seen: {before}"
            time.sleep(0.05)
            before = process_cpu.sample()
        time.sleep(0.3)
        after = process_cpu.sample()
        spent = process_cpu.spent(before, after)
        assert set(spent) == {"decode worker", ENGINE}, spent
        assert spent[ENGINE] > 0.1  # it spun
        assert spent["decode worker"] < 0.1  # it slept
        assert list(spent)[0] == ENGINE  # most first
        switches = process_cpu.switches(before, after)
        assert set(switches) == set(spent)
        # its second thread's naps: counted over every thread, not the first one's only
        assert switches["decode worker"][0] > 50, switches
    finally:
        for child in psutil.Process(worker.pid).children():
            child.kill()
        worker.kill()
        worker.wait()
