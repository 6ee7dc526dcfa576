"""The README is executable: its first command, verbatim, serves on the address it names; its
Python snippet, verbatim, gets an answer from it with the `openai` SDK; Ctrl-C stops it all.

Read from README.md when the test runs, so the test follows the README when it changes (seen:
`./scripts/serve.sh` with no flags crashed while every test passed `--port`). CI keeps the
README's port free for it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pdserve.bench.local_cluster import router_healthy
from tests.integration.conftest import START_TIMEOUT_S
from tests.integration.processes import SHM, alive, group_members, shm_left_since

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
STOP_S = 15  # Ctrl-C to exit


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def serve_command() -> str:
    """The first line of the README's first bash block, its comment left out."""
    first_line = readme_blocks("bash")[0].splitlines()[0]
    return first_line.split("#")[0].strip()


def snippet() -> str:
    (code,) = readme_blocks("python")
    return code


def snippet_address() -> str:
    """Where the snippet sends its requests (its `base_url`, without `/v1`)."""
    (base_url,) = re.findall(r'base_url="(http://[^"]+)/v1"', snippet())
    return base_url


def test_the_readme_serves_answers_and_stops_on_ctrl_c(tmp_path):
    command, url = serve_command(), snippet_address()
    assert command == "./scripts/serve.sh" and url == "http://127.0.0.1:8000"  # what it says now
    shm_before = set(SHM.iterdir())
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        serving = subprocess.Popen(
            command,
            shell=True,
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's foreground group: what Ctrl-C signals
        )
    group = serving.pid
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "pdserve ready" not in log.read_text():  # what the README says to wait for
            assert serving.poll() is None, f"{command} exited: {log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"{command} not serving: {log.read_text()[-4000:]}"
            time.sleep(0.5)
        assert router_healthy(url)

        answered = subprocess.run(
            [sys.executable, "-c", snippet()], capture_output=True, text=True, timeout=120
        )
        assert answered.returncode == 0, answered.stderr[-4000:]
        assert "completion_tokens=" in answered.stdout  # the usage it prints
        assert answered.stdout.split("CompletionUsage(")[0].strip()  # and an answer before it

        started = [p.pid for p in psutil.Process(serving.pid).children(recursive=True)]
        assert started  # the workers, their engines, the KV pool store
        os.killpg(group, signal.SIGINT)  # Ctrl-C
        serving.wait(timeout=STOP_S)
        settle = time.monotonic() + 10
        while (left := [pid for pid in started if alive(pid)]) and time.monotonic() < settle:
            time.sleep(0.2)
        assert not left, f"left running after Ctrl-C: {left}"
        assert not group_members(group)
        assert not shm_left_since(shm_before), "Ctrl-C left files in /dev/shm"
    finally:
        if serving.poll() is None or group_members(group):
            os.killpg(group, signal.SIGKILL)
            serving.wait(timeout=30)
