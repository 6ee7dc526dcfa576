"""processes.stop_group with real processes: a group whose only member left is a zombie (an
orphaned tensor-parallel rank whose new parent, PID 1, has not reaped it: in a container whose
PID 1 is pdserve it never does) has stopped, at once rather than after the grace and a SIGKILL."""

import os
import subprocess
import sys
import time

from pdserve.worker.processes import stop_group

# The group's leader forks a child and exits; the child exits once it is orphaned (or after
# 10 s: every wait has a deadline).
LEADER = """
import os, sys, time
leader = os.getpid()
child = os.fork()
if child == 0:
    deadline = time.monotonic() + 10
    while os.getppid() == leader and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)
print(child, flush=True)
"""

# A stand-in for a PID 1 that never reaps: a child subreaper (orphans below it become its
# children) that starts the group, waits until its orphan is a zombie, says the group's id and
# sleeps until killed (after 10 s without a zombie it exits, and the test fails reading its pid).
NEVER_REAPS = f"""
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
leader = subprocess.Popen([sys.executable, "-c", {LEADER!r}], stdout=subprocess.PIPE,
                          start_new_session=True)
child = int(leader.stdout.readline())
leader.wait(timeout=10)
def state():
    with open(f"/proc/{{child}}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
deadline = time.monotonic() + 10
while state() != "Z":
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.01)
print(leader.pid, flush=True)
time.sleep(120)
"""


def test_a_group_left_with_only_a_zombie_has_stopped():
    keeper = subprocess.Popen([sys.executable, "-c", NEVER_REAPS], stdout=subprocess.PIPE)
    try:
        group = int(keeper.stdout.readline())
        os.killpg(group, 0)  # the zombie is still the group's member
        started = time.monotonic()
        assert stop_group(group, grace_s=10)
        assert time.monotonic() - started < 5  # not the grace
    finally:
        keeper.kill()
        keeper.wait(timeout=10)
