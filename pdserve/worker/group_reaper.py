"""`python -m pdserve.worker.group_reaper`: started by a worker that leads its own process group, it
waits for that worker to die and then SIGKILLs the group, so a worker killed outright (SIGKILL,
the OOM killer) takes its vLLM engine-core and rank processes with it instead of leaving them
running, holding memory, as orphans. On a clean exit the worker has stopped them already and
the group holds only this reaper.

Deliberately tiny: no imports beyond the standard library, one poll a second.
"""

import os
import signal
import sys
import time

POLL_S = 0.5


def main(worker_pid: int) -> int:
    """`worker_pid` leads the process group to reap (so the group's id is the same)."""
    # A SIGTERM to the group stops the worker gracefully; the reaper stays to make sure.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == worker_pid:  # reparented: the worker is gone (maybe before we ran)
        time.sleep(POLL_S)
    os.killpg(worker_pid, signal.SIGKILL)  # its group's id; this reaper is in it: it ends here
    return 0


def start_for_this_worker() -> None:
    """Start the reaper if this process leads its process group (as `pdserve serve`, `up` and
    a container start workers); a worker run from a shell shares the shell's group and gets
    none: killing that group would kill more than the worker's own processes."""
    import subprocess

    if os.getpgid(0) != os.getpid():
        return
    subprocess.Popen(
        [sys.executable, "-m", "pdserve.worker.group_reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
