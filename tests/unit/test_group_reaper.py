"""pdserve/worker/group_reaper.py with real processes: a group leader SIGKILLed, alone or with
its whole group (as a launcher stops a worker that outstayed its grace), takes its other
processes and its engine's socket folder with it; a process that does not lead its group starts
no reaper."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.processes import alive

ROOT = Path(__file__).resolve().parents[2]

LEADER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from pdserve.worker import group_reaper
    group_reaper.start_for_this_worker(Path(sys.argv[1]))
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(engine.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("killed", ["the leader", "its whole group"])
def test_a_sigkilled_group_leader_takes_its_engine_processes_and_sockets_with_it(tmp_path, killed):
    sockets = tmp_path / "pdserve-vllm-rpc-x"  # pdserve/worker/rpc_folder.py
    sockets.mkdir()
    (sockets / "6949012b-ecf5-4bfb-b3be-8acf70b5f2c1").touch()
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, str(sockets)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        engine = int(leader.stdout.readline())
        assert alive(engine)
        if killed == "the leader":
            leader.kill()  # SIGKILL: no goodbye
        else:
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (alive(engine) or sockets.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(engine), "the engine process outlived its worker"
        assert not sockets.exists(), "the engine's socket folder outlived its worker"
    finally:
        leader.stdout.close()
        try:
            os.killpg(leader.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


NOT_A_LEADER = textwrap.dedent(
    """
    import os
    from pathlib import Path
    from pdserve.worker import group_reaper
    group_reaper.start_for_this_worker()
    def parent(process):
        try:
            return (process / "stat").read_text().rsplit(")", 1)[1].split()[1]
        except (FileNotFoundError, ProcessLookupError):  # it ended since the listing
            return None
    mine = str(os.getpid())
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and parent(p) == mine]
    print(len(children))
    """
)


def test_a_process_that_does_not_lead_its_group_gets_no_reaper():
    """Run from a shell pipeline, a worker shares its group: killing it would kill more."""
    probe = subprocess.run(
        [sys.executable, "-c", NOT_A_LEADER], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert probe.stdout.strip() == "0", probe
