"""vLLM's offline engine's greedy answers, the references the router's answers must equal: every
set the run's collected tests ask for, made by one process (tests/integration/offline_reference.py)
that the first stream starts as its first test sets up. One import of vLLM (~8 s of a core here)
serves them all, and a test that needs a set finds it made, or waits for that set alone, while
its clusters start: a set made by the test that first asked for it kept that stream waiting.

A set is asked for by name, its fixture's (`references.answers(name)`); the sets are made in
SETS' order, the first needed first."""

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pdserve.model_store.store import ensure_model
from tests.integration.prompts import (
    CHATS,
    DECODE_POOL_CONVERSATIONS,
    DISAGGREGATED_MAX_TOKENS,
    DISAGGREGATED_PROMPTS,
    MAX_TOKENS,
    POOL_FAULT_PROMPT,
    POOL_MAX_TOKENS,
    POOL_TURNS,
    PROMPTS,
    SAMPLING_CASES,
    TINY_LONG_PROMPT,
    TINY_MAX_TOKENS,
    TINY_PROMPTS,
)

SCRIPT = Path(__file__).with_name("offline_reference.py")
MADE_TIMEOUT_S = 900  # the process's whole run, on a host busy with both streams' clusters
POLL_S = 0.5
MOE_MODELS = ("tiny-moe", "tiny-mixtral")


def _prompts(texts: list[str], max_tokens: int) -> list[dict]:
    return [{"prompt": text, "max_tokens": max_tokens} for text in texts]


# A set's name (its fixture's) -> (the models it is made on, in turn; what they are asked).
SETS: dict[str, tuple[tuple[str, ...], dict]] = {
    "offline_reference": (  # SmolLM2: PROMPTS, SAMPLING_CASES, DISAGGREGATED_PROMPTS, the pool's
        ("smollm2",),
        {
            "prompts": [
                *_prompts(PROMPTS, MAX_TOKENS),
                *(
                    {"prompt": prompt, "max_tokens": MAX_TOKENS, "sampling": sampling}
                    for prompt, sampling in SAMPLING_CASES
                ),
                *_prompts(DISAGGREGATED_PROMPTS, DISAGGREGATED_MAX_TOKENS),
                *_prompts([*POOL_TURNS, POOL_FAULT_PROMPT], POOL_MAX_TOKENS),
            ],
            "chats": CHATS,
            "conversations": DECODE_POOL_CONVERSATIONS,
        },
    ),
    "tiny_reference": (("tiny",), {"prompts": _prompts(TINY_PROMPTS, TINY_MAX_TOKENS)}),
    "moe_reference": (  # TINY_PROMPTS, then TINY_LONG_PROMPT, on each MoE model
        MOE_MODELS,
        {
            "prompts": _prompts([*TINY_PROMPTS, TINY_LONG_PROMPT], TINY_MAX_TOKENS),
            "dtype": "bfloat16",
        },
    ),
}


def run_folder(tmp_path_factory) -> Path:
    """The folder both xdist streams share (the parent of their temporary folders)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


class References:
    """The run's reference sets in `folder`: `answers(name)` waits for one."""

    def __init__(self, folder: Path):
        self.folder = folder

    def output(self, name: str) -> Path:
        return self.folder / f"reference-{name}.json"

    def answers(self, name: str) -> list[dict]:
        """Set `name`'s answers, one object per model (offline_reference.py's OUTPUT_JSON),
        once its process has written them; fails the test if that process ended without them
        or did not make them within MADE_TIMEOUT_S."""
        done, deadline = self.output(name), time.monotonic() + MADE_TIMEOUT_S
        while not done.exists():
            if not self._maker_alive():
                if done.exists():  # written as it exited
                    break
                pytest.fail(f"the reference process ended without {name}:\n{self._log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{name} not made within {MADE_TIMEOUT_S} s:\n{self._log()}")
            time.sleep(POLL_S)
        return json.loads(done.read_text())

    def _maker_alive(self) -> bool:
        """The process making the sets runs (a zombie has ended: its stream has not reaped it)."""
        try:
            maker = psutil.Process(int((self.folder / "references.pid").read_text()))
            return maker.status() != psutil.STATUS_ZOMBIE
        except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
            return False

    def _log(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.folder / "references.log").read_text(errors="replace")[-4000:]
        return "(no log)"


@contextlib.contextmanager
def made_for(items: list[pytest.Item], folder: Path) -> Iterator[References]:
    """The sets `items` ask for, made by one process in `folder`: started here unless the
    other stream started it (a lock file says which), and, started here, waited for at the end
    (the other stream may still need it; it has long finished by then), killed at its deadline.
    A run cut short with Ctrl-C stops it too: it is in the run's process group."""
    needed = [name for name in SETS if any(name in item.fixturenames for item in items)]
    references = References(folder)
    with open(folder / "references.lock", "w") as lock:
        _lock(lock)  # held for a moment: the other stream's start
        started_there = (folder / "references.pid").exists()
        maker = _start(needed, references) if needed and not started_there else None
    if maker is None:
        yield references
        return
    try:
        yield references
    finally:
        try:
            maker.wait(timeout=MADE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            maker.kill()
            maker.wait()


def _lock(lock) -> None:
    """Take `lock` (the other stream holds it while it makes the models and starts the
    process: seconds), failing past MADE_TIMEOUT_S."""
    deadline = time.monotonic() + MADE_TIMEOUT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"the reference sets' lock not free within {MADE_TIMEOUT_S} s")
            time.sleep(POLL_S)


def _start(needed: list[str], references: References) -> subprocess.Popen:
    jobs = [
        {
            "output": str(references.output(name)),
            "models": [str(ensure_model(model)) for model in SETS[name][0]],
            "requests": {"chats": [], "chat_max_tokens": MAX_TOKENS, **SETS[name][1]},
        }
        for name in needed
    ]
    folder = references.folder
    (folder / "references-jobs.json").write_text(json.dumps(jobs))
    with open(folder / "references.log", "w") as log:
        maker = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(folder / "references-jobs.json")],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    (folder / "references.pid").write_text(str(maker.pid))
    return maker
