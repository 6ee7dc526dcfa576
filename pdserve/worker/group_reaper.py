"""`python -m pdserve.worker.group_reaper`: started by a worker that leads its own process group, it
waits for that worker to die and then SIGKILLs the group, so a worker killed outright (SIGKILL,
the OOM killer) takes its vLLM engine-core and rank processes with it instead of leaving them
running, holding memory, as orphans; then it removes the folder of the engine's IPC sockets
(pdserve/worker/rpc_folder.py). It runs in a session of its own, outside the group: a launcher
that kills the worker's whole group (`pdserve serve` stopping a worker that outstayed its grace,
the Ray path's process keeper once its worker exited) would otherwise kill it before it removed
the folder. On a clean exit the worker has stopped its engine and removed the folder already:
the reaper finds the group empty and exits.

Deliberately tiny: no imports beyond the standard library, one poll every half second.
"""

import os
import shutil
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5


def main(worker_pid: int, rpc_folder: str = "") -> int:
    """`worker_pid` leads the process group to reap (so the group's id is the same);
    `rpc_folder`, if any, is its engine's socket folder."""
    # Signals that stop the worker are not for it: it stays until the worker is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == worker_pid:  # reparented: the worker is gone (maybe before we ran)
        time.sleep(POLL_S)
    try:
        os.killpg(worker_pid, signal.SIGKILL)  # its group's id
    except ProcessLookupError:  # nothing left in it: a clean exit, or the whole group killed
        pass
    if rpc_folder:
        shutil.rmtree(rpc_folder, ignore_errors=True)
    return 0


def start_for_this_worker(rpc_folder: Path | None = None) -> None:
    """Start the reaper if this process leads its process group (as `pdserve serve`, `up` and
    a container start workers); a worker run from a shell shares the shell's group and gets
    none: killing that group would kill more than the worker's own processes. `rpc_folder`:
    the folder to remove with the group (pdserve/worker/rpc_folder.py), if any."""
    import subprocess

    if os.getpgid(0) != os.getpid():
        return
    subprocess.Popen(
        [sys.executable, "-m", "pdserve.worker.group_reaper", str(os.getpid())]
        + ([str(rpc_folder)] if rpc_folder else []),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outside the group it reaps: a kill of the group spares it
    )


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), *sys.argv[2:]))
