"""processes.stop_leader_first with real processes: a leader that stops its own children on
SIGTERM is asked alone and its group goes within the grace; a leader that ignores SIGTERM has
its whole group SIGKILLed after the grace."""

import subprocess
import time

from pdserve.worker.processes import stop_leader_first
from tests.integration.processes import group_members

# Each reaps what it started (the host's init may take seconds to reap an orphan).
STOPS_ITS_CHILD = (
    "trap 'kill -KILL $child; wait $child; exit 0' TERM; "
    "bash -c \"trap '' TERM; exec sleep 60\" & child=$!; echo ready; wait; wait"
)
IGNORES_SIGTERM = "trap '' TERM; echo ready; read -r _"  # a builtin: no child


def leader(script: str) -> subprocess.Popen:
    process = subprocess.Popen(
        ["bash", "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout.readline() == "ready\n"
    return process


def test_a_leader_that_stops_its_children_is_asked_alone_and_the_group_goes():
    process = leader(STOPS_ITS_CHILD)
    started = time.monotonic()
    assert stop_leader_first(process.pid, grace_s=10)
    assert time.monotonic() - started < 5
    assert group_members(process.pid) == []


def test_a_leader_that_ignores_sigterm_has_its_group_killed_after_the_grace():
    process = leader(IGNORES_SIGTERM)
    assert not stop_leader_first(process.pid, grace_s=0.5)
    assert group_members(process.pid) == []
