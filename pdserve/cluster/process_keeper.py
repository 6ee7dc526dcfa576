"""`python -m pdserve.cluster.process_keeper COMMAND...`: run COMMAND as a child in its own process
group that gets SIGTERM when this keeper dies, wait for it, then SIGKILL what is left of its group.

Ray SIGKILLs an actor's direct child processes when the actor dies. Were the worker that child,
it would die with no goodbye and its registry entry would only expire. With the keeper in
between, the keeper takes the SIGKILL and the worker gets SIGTERM: it leaves the pools and shuts
its engine down.

The worker leads its own process group, as under `serve` and in a container, so it starts its
group reaper (pdserve/worker/group_reaper.py): killed outright (SIGKILL, the OOM killer), it takes
its
vLLM engine processes with it, whether or not this keeper is alive. A SIGTERM to the keeper (its
actor's `stop` signals the keeper's group) is passed on to the worker's group; a worker still
running KILL_AFTER_S later is SIGKILLed. Once COMMAND exits, its group is SIGKILLed at once, and
the keeper exits with COMMAND's code (128 + the signal's number when a signal ended it, as a
shell reports it).
"""

import os
import signal
import subprocess
import sys

from pdserve.worker.processes import die_with_parent

KILL_AFTER_S = 15  # under ProcessHost.stop's 20 s grace, so the keeper ends its worker itself


def main(command: list[str]) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the worker's group exists to pass it on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = subprocess.Popen(command, process_group=0, preexec_fn=_child_setup)
    signal.signal(signal.SIGALRM, lambda *_: _signal_group(worker.pid, signal.SIGKILL))
    signal.signal(signal.SIGTERM, lambda *_: _stop(worker.pid))
    code = worker.wait()
    _signal_group(worker.pid, signal.SIGKILL)  # what it left; its reaper does too, a moment later
    print(f"process_keeper: exited with code {code}: {' '.join(command[:5])}", flush=True)
    return 128 - code if code < 0 else code


def _stop(group: int) -> None:
    _signal_group(group, signal.SIGTERM)
    signal.alarm(KILL_AFTER_S)


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _child_setup() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # undo the keeper's ignoring for the child
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
