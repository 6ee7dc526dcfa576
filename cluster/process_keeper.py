"""`python -m cluster.process_keeper COMMAND...`: run COMMAND as a child that gets SIGTERM
when this keeper dies, and wait for it.

Ray SIGKILLs an actor's direct child processes when the actor dies. Were the worker that child,
it would die with no goodbye: its vLLM engine-core process would be orphaned (seen: it kept its
memory after the cluster was gone) and its registry entry would only expire. With the keeper in
between, the keeper takes the SIGKILL and the worker gets SIGTERM: it leaves the pools and shuts
its engine down. The keeper ignores SIGTERM itself; a SIGTERM to the process group reaches the
worker, and the keeper exits with the worker's exit code.
"""

import signal
import subprocess
import sys

from worker.processes import die_with_parent


def main(command: list[str]) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(command, preexec_fn=_child_setup)
    return child.wait()


def _child_setup() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # undo the keeper's ignoring for the child
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
