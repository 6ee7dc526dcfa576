"""A folder of the worker's own for its vLLM engine's ZMQ IPC sockets, removed when it stops.

vLLM binds its engine's local ZMQ sockets (the engine core's input and output, its handshake, a
tensor-parallel group's message queues) at `VLLM_RPC_BASE_PATH/<uuid4>`, by default in the
system's temporary folder, and an engine stopped by a signal leaves them there: one
`./scripts/serve.sh` stopped by Ctrl-C left 6, a day of test runs ~3,500 in /tmp. So the worker
points VLLM_RPC_BASE_PATH at a folder of its own before vLLM reads it (vLLM reads it when it
names a socket; its engine core caches its environment only once started) and removes the
folder once its engine has stopped; its group reaper removes it when the worker is killed
outright. Every engine process has it: the engine core and the multiprocessing executor's ranks
inherit the worker's environment, and vLLM copies its variables to its Ray executor's ranks,
which run on the worker's node (pdserve/cluster/ray_launcher.py packs a worker's placement
group onto one node).
"""

import os
import shutil
import tempfile
from pathlib import Path

RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"  # vLLM's
PREFIX = "pdserve-vllm-rpc-"


def make_private() -> Path | None:
    """Make the folder in the temporary folder and point VLLM_RPC_BASE_PATH at it; None when
    VLLM_RPC_BASE_PATH is set already: that folder is the user's, to keep."""
    if RPC_BASE_PATH_ENV in os.environ:
        return None
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    os.environ[RPC_BASE_PATH_ENV] = str(folder)
    return folder


def remove(folder: Path | None) -> None:
    """Remove `folder` (from `make_private`) and the sockets left in it, if any."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
