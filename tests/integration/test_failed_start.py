"""A worker whose engine refuses the model: `pdserve serve` says why in its own output (the root
cause, not vLLM's "Engine core initialization failed. See root cause above.") and where the log
is, exits 1, and leaves nothing in /dev/shm (seen: a TP-2 engine that failed to start left its
communicator's `vllm_dist_*` files, 8 MiB)."""

import re
import subprocess
import sys

from safetensors.torch import load_file, save_file

from pdserve.model_store.store import ensure_model
from tests.integration.processes import SHM, shm_left_since

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
