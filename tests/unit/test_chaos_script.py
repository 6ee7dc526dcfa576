"""scripts/chaos.py's choices, without a cluster: which events each kind of cluster takes turns
with (worker kills by role, flex workers included), and which processes count as a cluster's
workers. The cluster and the processes are fakes; the soak itself runs against real ones
(docs/operating.md, and its short CI form in tests/integration/test_cluster_ray.py)."""

import asyncio
import importlib.util
import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("chaos_script", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeCluster:
    """Stands in for one of chaos.py's clusters: its roles and the worker pids of each."""

    def __init__(self, roles: list[str], pids: dict[str, list[int]]) -> None:
        self.roles = roles
        self.pids = pids
        self.routers = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    def worker_pids(self, role: str) -> list[int]:
        return self.pids.get(role, [])


class FakeProcess:
    """Stands in for a psutil.Process: a command line, a status, and an id."""

    def __init__(self, pid: int, args: list[str], status: str = psutil.STATUS_SLEEPING) -> None:
        self.pid = pid
        self.args = args
        self.state = status

    def cmdline(self) -> list[str]:
        return self.args

    def status(self) -> str:
        return self.state


def worker_command(role: str, cluster: str) -> list[str]:
    settings = json.dumps({"role": role, "cluster": cluster}, separators=(",", ":"))
    return [sys.executable, "-m", "pdserve.cli", "worker", "--settings-json", settings]


def test_a_flex_cluster_kills_flex_workers_and_a_fixed_one_each_role_in_turn(chaos):
    args = SimpleNamespace(kill_every=60, freeze_s=10)
    flex = chaos.Chaos(args, FakeCluster(["flex"], {}), ["kill", "freeze"])
    assert [name for name, _ in flex.turns] == ["kill -9 flex", "SIGSTOP worker"]
    fixed = chaos.Chaos(args, FakeCluster(["prefill", "decode"], {}), list(chaos.EVENTS))
    assert [name for name, _ in fixed.turns] == [
        "kill -9 prefill",
        "kill -9 decode",
        "SIGSTOP worker",
        "kill -9 router",
        "Redis restart",
    ]


def test_an_event_with_no_worker_to_take_is_not_counted(chaos, monkeypatch):
    killed = []
    monkeypatch.setattr(chaos.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    args = SimpleNamespace(kill_every=0.01, freeze_s=0)
    cluster = FakeCluster(["prefill", "decode"], {"decode": [4242]})
    events = chaos.Chaos(args, cluster, ["kill"])

    async def two_turns():  # the prefill kill's turn comes first, then the decode kill's
        stop = asyncio.Event()
        task = asyncio.create_task(events.run(stop))
        while not killed:
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(two_turns(), 5))
    assert events.events["kill -9 prefill"] == 0  # no prefill worker: nothing happened
    assert events.events["kill -9 decode"] >= 1
    assert set(killed) == {(4242, signal.SIGKILL)}


def test_workers_are_told_by_role_and_cluster_and_keepers_routers_and_zombies_are_not(chaos):
    processes = [
        FakeProcess(1, worker_command("decode", "chaos")),
        FakeProcess(2, worker_command("decode", "other")),
        FakeProcess(3, worker_command("prefill", "chaos")),
        FakeProcess(4, [*worker_command("decode", "chaos"), "pdserve.cluster.process_keeper"]),
        FakeProcess(5, worker_command("decode", "chaos"), status=psutil.STATUS_ZOMBIE),
        FakeProcess(6, ["python", "-m", "pdserve.cli", "router", "--settings-json", "{}"]),
    ]
    assert chaos.worker_pids(processes, "decode", "chaos") == [1]
    assert chaos.worker_pids(processes, "decode") == [1, 2]  # serve's: its own children
    assert chaos.worker_pids(processes, "prefill", "chaos") == [3]
