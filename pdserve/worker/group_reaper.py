"""`python -m pdserve.worker.group_reaper`: started by a worker that leads its own process group, it
waits for that worker to die and then SIGKILLs the group, so a worker killed outright (SIGKILL,
the OOM killer) takes its vLLM engine-core and rank processes with it instead of leaving them
running, holding memory, as orphans, and removes the folder of the engine's IPC sockets
(pdserve/worker/rpc_folder.py). On a clean exit the worker has stopped them and removed the
folder already, and the group holds only this reaper.

Deliberately tiny: no imports beyond the standard library, one poll a second.
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
    # A SIGTERM to the group stops the worker gracefully; the reaper stays to make sure.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == worker_pid:  # reparented: the worker is gone (maybe before we ran)
        time.sleep(POLL_S)
    if rpc_folder:
        # Before the kill, which ends this reaper too. Removing a socket's name closes nothing:
        # the engine processes still running for this instant keep their sockets.
        shutil.rmtree(rpc_folder, ignore_errors=True)
    os.killpg(worker_pid, signal.SIGKILL)  # its group's id; this reaper is in it: it ends here
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
    )


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), *sys.argv[2:]))
