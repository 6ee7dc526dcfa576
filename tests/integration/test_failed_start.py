"""A worker whose engine refuses the model: `pdserve serve` says why in its own output (the root
cause, not vLLM's "Engine core initialization failed. See root cause above.") and where the log
is, exits 1, and leaves nothing in /dev/shm (seen: a TP-2 engine that failed to start left its
communicator's `vllm_dist_*` files, 8 MiB). Nor does a TP-2 start that a stop cuts short (the
ranks die of the group's SIGTERM with those files made: the same 8 MiB were left). Nor, either
way, the engine's ZMQ IPC sockets (seen: each stopped engine left its `/tmp/<uuid>` sockets):
each worker's folder for them is gone."""

import re
import signal
import subprocess
import sys

from safetensors.torch import load_file, save_file

from pdserve.model_store.store import ensure_model
from pdserve.worker.processes import spawn, stop_group
from pdserve.worker.shm_leftovers import mapped_by
from tests.integration.processes import SHM, descendants, rpc_folders_named_in, shm_left_since
from tests.waiting import wait_for

MISSING = "model.norm.weight"


def test_a_refused_model_gives_the_root_cause_and_leaves_nothing(tmp_path):
    model = tmp_path / "tiny-without-a-weight"
    model.mkdir()
    for path in ensure_model("tiny").iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors[MISSING]  # vLLM refuses a checkpoint that lacks a weight, in every rank
    save_file(tensors, weights, metadata={"format": "pt"})
    shm_before = set(SHM.iterdir())

    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model)]
        + ["--prefill-tensor-parallel-size", "2", "--kv-cache-gib", "0.25", "--port", "0"]
        + ["--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-4000:]
    output = done.stdout + done.stderr
    # Seen exiting, or first reporting its engine failed through its health: either way, why
    (cause,) = re.findall(r"worker \S+ (?:exited with code 1|failed): (.*)", output) or [output]
    assert cause.startswith("ValueError: ") and MISSING in cause, output[-4000:]
    assert f"(the whole log: {tmp_path / 'logs'}/" in output
    assert not shm_left_since(shm_before), "a failed start left files in /dev/shm"
    sockets = rpc_folders_named_in(tmp_path / "logs")
    assert sockets, "no worker said where its engine's sockets go"
    assert not [folder for folder in sockets if folder.exists()], "a failed start left sockets"


def test_a_stop_while_a_tp2_engine_starts_leaves_nothing(tmp_path):
    """SIGTERM (Ctrl-C) to `pdserve serve` once its TP-2 prefill worker's ranks have made their
    communicator's files: the group's SIGTERM kills the ranks mid-start, and the worker removes
    what they left before it exits."""
    ensure_model("tiny")
    shm_before = set(SHM.iterdir())
    serve = spawn(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", "tiny"]
        + ["--prefill-tensor-parallel-size", "2", "--kv-cache-gib", "0.25", "--port", "0"]
        + ["--log-dir", str(tmp_path / "logs")],
        tmp_path / "serve.log",
    )
    try:
        wait_for(
            lambda: any(
                path.name.startswith("vllm_dist_")
                for path in mapped_by(descendants(serve.pid)) - shm_before
            ),
            300,
            "the TP-2 ranks' communicator files",
        )
        sockets = rpc_folders_named_in(tmp_path / "logs")
        assert any(path.is_socket() for folder in sockets for path in folder.iterdir())
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()[-4000:]
    finally:
        stop_group(serve.pid, process=serve)
    assert not shm_left_since(shm_before), "a stopped start left files in /dev/shm"
    assert not [folder for folder in sockets if folder.exists()], "a stopped start left sockets"
