"""`pdserve up` waits until every worker it placed is in the registry, read as the registry's
records are (their identity: the worker's Health reply kept whole), and says how long it took."""

from types import SimpleNamespace

from pdserve.cluster import ray_launcher, up
from pdserve.protocol import worker_pb2
from pdserve.protocol.registry import WorkerRecord


def test_up_returns_once_every_placed_worker_has_a_record(monkeypatch):
    names = ["prefill-0", "decode-0"]
    reads = iter([names[:1], names])  # one joined, then both
    said = []

    def members(url: str, cluster: str) -> list[WorkerRecord]:
        return [
            WorkerRecord(worker_pb2.HealthReply(worker_id=name, role=name.split("-")[0]), "a:1")
            for name in next(reads)
        ]

    monkeypatch.setattr(up, "read_members", members)
    running = ray_launcher.HostedProcess(pid=1, node="n", log="l")
    monkeypatch.setattr(up.ray_launcher, "describe", lambda name: running)
    monkeypatch.setattr(up.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(up, "say", said.append)
    slots = [SimpleNamespace(name=name) for name in names]
    up.wait_joined(SimpleNamespace(name="c"), SimpleNamespace(registry_url="redis://x"), slots, 60)
    assert said and said[-1].startswith("2 worker(s) joined after")
