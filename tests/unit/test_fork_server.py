"""The fork server (pdserve/worker/fork_server.py) with a real server process and real forked
children (tests/unit/fork_child.py), preloading nothing: a child gets exactly the environment,
session, log and arguments it asked for, its exit code comes back as Popen's would, and
closing the server ends it and any child still running."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.worker.fork_messages import (
    Exited,
    Fork,
    Forked,
    ForkFailed,
    ForkMessageError,
    Ready,
    decode,
    encode,
)
from pdserve.worker.fork_server import REPLY_TIMEOUT_S, ForkServer, ForkServerError
from pdserve.worker.processes import stop_group
from tests.waiting import wait_for

CHILD = [sys.executable, "-m", "tests.unit.fork_child"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's tests (each starts ~1 s of a core)."""
    forks = ForkServer(tmp_path_factory.mktemp("forks") / "fork-server.log", preload=("json",))
    yield forks
    forks.close()


def seen(path: Path) -> dict:
    wait_for(path.exists, 30, f"{path} written by the child")
    return json.loads(path.read_text())


def test_a_child_gets_its_environment_session_log_and_arguments(server, tmp_path):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd(), "ONLY_THIS": "1"}
    child = server.spawn([*CHILD, str(tmp_path / "seen.json"), "7"], tmp_path / "child.log", env)
    assert child.wait(timeout=30) == 7
    assert child.poll() == 7 and child.returncode == 7
    view = seen(tmp_path / "seen.json")
    assert view["env"] == env
    assert view["pid"] == child.pid
    assert view["group"] == view["session"] == child.pid  # leads its own session and group
    assert view["parent"] == server.process.pid
    assert view["argv"][1:] == [str(tmp_path / "seen.json"), "7"]
    assert view["main"] == "tests.unit.fork_child"
    assert view["sigint"], "Ctrl-C must stop a child as it stops a freshly started one"
    assert "child started" in (tmp_path / "child.log").read_text()


def test_a_signalled_child_reports_the_signal_and_stop_group_sees_it_gone(server, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = server.spawn([*CHILD, str(tmp_path / "seen.json")], tmp_path / "child.log", env)
    seen(tmp_path / "seen.json")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert stop_group(child.pid, grace_s=10, process=child)
    assert child.returncode == -signal.SIGTERM


def test_many_children_each_get_their_own_exit_code(server, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    children = [
        server.spawn([*CHILD, str(tmp_path / f"{i}.json"), str(i)], tmp_path / f"{i}.log", env)
        for i in range(6)
    ]
    assert [child.wait(timeout=30) for child in children] == list(range(6))
    assert len({child.pid for child in children}) == 6


def test_closing_the_server_ends_a_child_still_running(tmp_path):
    forks = ForkServer(tmp_path / "fork-server.log", preload=())
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = forks.spawn([*CHILD, str(tmp_path / "seen.json")], tmp_path / "child.log", env)
    seen(tmp_path / "seen.json")
    forks.close()
    assert forks.process.returncode == 0
    deadline = time.monotonic() + 10  # its parent-death signal (SIGTERM) ends it
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child.pid)
    assert child.wait(timeout=5) == -signal.SIGTERM


def test_only_modules_are_forked_and_a_failed_preload_is_a_clear_error(server, tmp_path):
    with pytest.raises(ValueError, match="python -m"):
        server.spawn([sys.executable, "script.py"], tmp_path / "x.log", dict(os.environ))
    with pytest.raises(ForkServerError, match="fork-server.log"):
        ForkServer(tmp_path / "fork-server.log", preload=("no_such_module_here",))
    assert "No module named 'no_such_module_here'" in (tmp_path / "fork-server.log").read_text()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_malformed_request_is_answered_with_an_error_and_the_server_keeps_serving(
    server, tmp_path
):
    with server._spawning:  # as `spawn` writes a request, with a field of the wrong type
        os.write(server._requests, b'{"kind": "fork", "module": 7}\n')
        with pytest.raises(ForkServerError, match="Fork"):
            server._await_reply(REPLY_TIMEOUT_S, "fork")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = server.spawn([*CHILD, str(tmp_path / "seen.json"), "3"], tmp_path / "child.log", env)
    assert child.wait(timeout=30) == 3


@pytest.mark.parametrize(
    "message",
    [
        Fork("m", ("a", "b"), {"K": "v"}, "/tmp/x.log", "python -m m a b"),
        Ready(),
        Forked(12),
        ForkFailed("fork failed: no memory"),
        Exited(12, -15),
    ],
)
def test_each_fork_message_survives_its_line(message):
    assert decode(encode(message), type(message)) == message


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"[1, 2]",
        b'{"kind": "forked"}',  # its pid missing
        b'{"kind": "forked", "pid": "12"}',  # a string for an int
        b'{"kind": "forked", "pid": true}',  # a bool is no int
        b'{"kind": "forked", "pid": 12, "extra": 1}',
        b'{"kind": "exited", "pid": 12, "code": 0}',  # a kind not expected here
        b'{"kind": "nothing"}',
        b'{"pid": 12}',  # no kind
    ],
)
def test_a_line_that_is_no_expected_message_is_refused_cleanly(line):
    with pytest.raises(ForkMessageError):
        decode(line, (Forked, ForkFailed))


@pytest.mark.parametrize("wrong", [{"argv": [1]}, {"env": {"K": 1}}, {"env": ["K"]}])
def test_a_fork_request_checks_its_arguments_and_environment(wrong):
    good = {"kind": "fork", "module": "m", "argv": ["a"], "env": {"K": "v"}, "log": "x.log"}
    good["title"] = "python -m m a"
    assert decode(json.dumps(good), Fork).argv == ("a",)
    with pytest.raises(ForkMessageError):
        decode(json.dumps({**good, **wrong}), Fork)
