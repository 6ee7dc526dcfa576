"""`python -m tests.unit.fork_child OUT [CODE]`: a stand-in for a worker, forked by the fork
server in tests/unit/test_fork_server.py. It writes what a worker would inherit (its
environment, process group, parent, arguments, main module) to OUT, prints a line to its log,
then exits with CODE, or, with no CODE, waits to be signalled."""

import json
import os
import signal
import sys

if __name__ == "__main__":
    out, *code = sys.argv[1:]
    print("child started", flush=True)
    seen = {
        "env": dict(os.environ),
        "group": os.getpgid(0),
        "session": os.getsid(0),
        "pid": os.getpid(),
        "parent": os.getppid(),
        "argv": sys.argv,
        "main": sys.modules["__main__"].__spec__.name,
        "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    }
    with open(out + ".tmp", "w") as file:
        json.dump(seen, file)
    os.rename(out + ".tmp", out)
    if code:
        sys.exit(int(code[0]))
    signal.pause()
