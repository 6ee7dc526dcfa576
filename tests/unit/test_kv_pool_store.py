"""The host KV pool's store (kv_transfer/pool/store.py) as a real process, and its clients
(kv_transfer/pool/client.py) over a real Unix socket: the memory is shared and named nowhere,
a client of another namespace is refused, a client that goes away releases what it held, and a
store that dies makes calls answer None at once and is found again when it comes back."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kv_transfer.pool import client as pool_client
from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.store import header_bytes
from kv_transfer.pool.wire import HELLO_BYTES, socket_address
from pdserve.cluster.local_services import start_kv_pool
from pdserve.worker.processes import stop_group
from tests.waiting import wait_for

SLOT = 4096
NAMESPACE = "model x, layout y"


def start_store(address: str, budget: int = 4 * SLOT) -> subprocess.Popen:
    log_path = Path(tempfile.mkdtemp(prefix="kv-pool-")) / "kv-pool.log"
    return start_kv_pool(log_path, budget, address)[1]


def process_state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def address():
    return f"@pdserve-kv-pool-test-{secrets.token_hex(4)}"


@pytest.fixture
def store(address):
    process = start_store(address)
    yield process
    stop_group(process.pid, process=process)


def test_two_clients_share_the_memory_and_nothing_is_named_in_dev_shm(store, address):
    before = set(Path("/dev/shm").iterdir())
    writer, reader = PoolClient(address, NAMESPACE, SLOT), PoolClient(address, NAMESPACE, SLOT)
    plan = writer.call("prepare_store", [b"k1"])["stored"]
    (slot,) = plan["slots"]
    offset = writer.header_bytes + slot * SLOT
    writer.memory[offset : offset + 5] = b"hello"
    writer.call("complete_store", [b"k1"], success=True)
    assert reader.call("lookup", [b"k1"]) == {"found": 1}
    assert reader.call("prepare_load", [b"k1"]) == {"slots": [slot]}
    assert reader.memory[offset : offset + 5] == b"hello"
    assert reader.slots == 4 and reader.header_bytes == header_bytes(4)
    assert set(Path("/dev/shm").iterdir()) == before
    stats = reader.call("stats")
    assert stats["used"] == 1 and stats["bytes"] == SLOT and stats["hits"] == 1
    assert stats["namespace"] == NAMESPACE


def test_a_client_of_another_namespace_is_refused_and_the_first_keeps_working(store, address):
    first = PoolClient(address, NAMESPACE, SLOT)
    assert first.call("lookup", [b"k"]) == {"found": 0}
    other = PoolClient(address, "another model", SLOT)
    assert other.call("lookup", [b"k"]) is None
    assert not other.connected()
    assert PoolClient(address, NAMESPACE, 2 * SLOT).call("lookup", [b"k"]) is None
    assert first.call("lookup", [b"k"]) == {"found": 0}


def test_a_client_that_goes_away_releases_its_pins_and_unfinished_writes(store, address):
    keeper, leaver = PoolClient(address, NAMESPACE, SLOT), PoolClient(address, NAMESPACE, SLOT)
    keys = [b"a", b"b", b"c"]
    keeper.call("prepare_store", keys)
    keeper.call("complete_store", keys, success=True)
    leaver.call("prepare_load", keys)  # pins all three
    leaver.call("prepare_store", [b"d"])  # the fourth slot, never completed
    assert keeper.call("prepare_store", [b"e", b"f"]) == {"stored": None}
    leaver.close()
    wait_for(lambda: keeper.call("stats")["used"] == 3, 10, "the leaver's write discarded")
    assert len(keeper.call("prepare_store", [b"e", b"f"])["stored"]["evicted"]) == 1


def test_a_dead_store_answers_none_at_once_and_a_new_one_is_found(address, monkeypatch):
    monkeypatch.setattr(pool_client, "FIRST_RETRY_S", 0.2)
    monkeypatch.setattr(pool_client, "LAST_RETRY_S", 0.4)
    store = start_store(address)
    client = PoolClient(address, NAMESPACE, SLOT)
    try:
        assert client.call("lookup", [b"k"]) == {"found": 0}
        first_id = client.store_id
        os.killpg(store.pid, signal.SIGKILL)
        store.wait(10)
        started = time.monotonic()
        assert client.call("lookup", [b"k"]) is None
        assert client.call("lookup", [b"k"]) is None
        assert time.monotonic() - started < 1
        store = start_store(address)
        wait_for(lambda: client.call("lookup", [b"k"]) is not None, 10, "the new store found")
        assert client.store_id != first_id
    finally:
        stop_group(store.pid, process=store)


def test_a_hung_store_costs_one_call_deadline_then_calls_return_at_once(store, address):
    client = PoolClient(address, NAMESPACE, SLOT)
    assert client.call("lookup", [b"k"]) == {"found": 0}
    os.kill(store.pid, signal.SIGSTOP)
    try:  # stopped once the kernel says so (a busy host delivers the signal later)
        wait_for(lambda: process_state(store.pid) == "T", 5, "the store to stop")
        started = time.monotonic()
        assert client.call("lookup", [b"k"]) is None
        assert time.monotonic() - started < 2 * pool_client.CALL_TIMEOUT_S
        started = time.monotonic()
        for _ in range(20):  # within the back-off: no call waits on the store again
            assert client.call("lookup", [b"k"]) is None
        assert time.monotonic() - started < 0.1
    finally:
        os.kill(store.pid, signal.SIGCONT)
    # and it stops on SIGTERM with a client still connected (a client's thread took the signal
    # once, leaving the main thread in accept() until SIGKILL 20 s later)
    assert stop_group(store.pid, grace_s=5.0, process=store)


def test_an_observer_gets_the_figures_and_no_memory(store, address):
    observer = PoolClient(address, namespace=None)
    assert observer.call("stats")["slots"] == 0  # no worker has said what the pool holds
    worker = PoolClient(address, NAMESPACE, SLOT)
    worker.call("prepare_store", [b"k"])
    worker.call("complete_store", [b"k"], success=True)
    stats = observer.call("stats")
    assert (stats["slots"], stats["used"], stats["bytes"]) == (4, 1, SLOT)
    assert observer.memory is None


def test_an_observer_follows_the_contents_as_changes_after_what_it_has(store, address):
    """What the routers' copies of a pool are built from (router/workers/kv_pool_contents.py)."""
    observer, worker = PoolClient(address, namespace=None), PoolClient(address, NAMESPACE, SLOT)
    for key in (b"k1", b"k2"):
        assert worker.call("prepare_store", [key])["stored"]["keys"] == [key.hex()]
        assert worker.call("complete_store", [key], success=True) == {}
    first = observer.call("contents", store_id="", since=0)
    assert first["reset"] and set(first["added"]) == {b"k1".hex(), b"k2".hex()}
    worker.call("drop", [b"k1"])
    worker.call("prepare_store", [b"k3"])
    worker.call("complete_store", [b"k3"], success=True)
    changes = observer.call("contents", store_id=first["store_id"], since=first["sequence"])
    assert not changes["reset"] and changes["sequence"] == first["sequence"] + 2
    assert (changes["added"], changes["removed"]) == ([b"k3".hex()], [b"k1".hex()])
    other = observer.call("contents", store_id="another store", since=changes["sequence"])
    assert other["reset"] and set(other["added"]) == {b"k2".hex(), b"k3".hex()}


def test_no_client_can_resize_the_memory_and_an_absurd_slot_size_is_refused(address):
    store = start_store(address, budget=1 << 30)
    try:
        assert PoolClient(address, "tiny slots", 1).call("lookup", [b"k"]) is None  # 2^30 slots
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(socket_address(address))
            hello = {"op": "hello", "namespace": NAMESPACE, "slot_bytes": SLOT}
            raw.sendall((json.dumps(hello) + "\n").encode())
            _, (fd,), _, _ = socket.recv_fds(raw, HELLO_BYTES, 1)
            try:
                with pytest.raises(PermissionError):  # sealed: a shrink faults others' reads
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
    finally:
        stop_group(store.pid, process=store)


def test_the_probe_passes_only_while_the_store_answers(store, address):
    """The Kubernetes probe of a worker's store (pdserve/cluster/k8s/render.py): a store that
    answers passes; a stopped one (its socket still accepts) and a gone one fail, in bounded
    time."""

    def probe() -> int:
        command = [sys.executable, "-m", "kv_transfer.pool.store", "--address", address, "--probe"]
        return subprocess.run(command, timeout=30).returncode

    assert probe() == 0
    os.killpg(store.pid, signal.SIGSTOP)
    try:
        assert probe() == 1
    finally:
        os.killpg(store.pid, signal.SIGCONT)
    assert probe() == 0
    stop_group(store.pid, process=store)
    assert probe() == 1
