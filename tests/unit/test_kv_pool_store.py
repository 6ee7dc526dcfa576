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
from kv_transfer.pool.index import Changes
from kv_transfer.pool.store import header_bytes
from kv_transfer.pool.wire import (
    HELLO_BYTES,
    CompleteStore,
    Done,
    Drop,
    Found,
    GetContents,
    GetStats,
    Hello,
    Lookup,
    Pinned,
    PrepareLoad,
    PrepareStore,
    Reserved,
    encode,
    socket_address,
)
from pdserve.cluster.local_services import start_kv_pool
from pdserve.worker.pool_contents import PoolContentsSource
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
    plan = writer.call(PrepareStore((b"k1",))).stored
    (slot,) = plan.slots
    offset = writer.header_bytes + slot * SLOT
    writer.memory[offset : offset + 5] = b"hello"
    writer.call(CompleteStore((b"k1",), success=True))
    assert reader.call(Lookup((b"k1",))) == Found(1)
    assert reader.call(PrepareLoad((b"k1",))) == Pinned((slot,))
    assert reader.memory[offset : offset + 5] == b"hello"
    assert reader.slots == 4 and reader.header_bytes == header_bytes(4)
    assert set(Path("/dev/shm").iterdir()) == before
    stats = reader.call(GetStats())
    assert stats.used == 1 and stats.bytes == SLOT and stats.hits == 1
    assert stats.namespace == NAMESPACE


def test_a_client_of_another_namespace_is_refused_and_the_first_keeps_working(store, address):
    first = PoolClient(address, NAMESPACE, SLOT)
    assert first.call(Lookup((b"k",))) == Found(0)
    other = PoolClient(address, "another model", SLOT)
    assert other.call(Lookup((b"k",))) is None
    assert not other.connected()
    assert PoolClient(address, NAMESPACE, 2 * SLOT).call(Lookup((b"k",))) is None
    assert first.call(Lookup((b"k",))) == Found(0)


def test_a_client_that_goes_away_releases_its_pins_and_unfinished_writes(store, address):
    keeper, leaver = PoolClient(address, NAMESPACE, SLOT), PoolClient(address, NAMESPACE, SLOT)
    keys = (b"a", b"b", b"c")
    keeper.call(PrepareStore(keys))
    keeper.call(CompleteStore(keys, success=True))
    leaver.call(PrepareLoad(keys))  # pins all three
    leaver.call(PrepareStore((b"d",)))  # the fourth slot, never completed
    assert keeper.call(PrepareStore((b"e", b"f"))) == Reserved(None)
    leaver.close()
    wait_for(lambda: keeper.call(GetStats()).used == 3, 10, "the leaver's write discarded")
    assert len(keeper.call(PrepareStore((b"e", b"f"))).stored.evicted) == 1


def test_a_dead_store_answers_none_at_once_and_a_new_one_is_found(address, monkeypatch):
    monkeypatch.setattr(pool_client, "FIRST_RETRY_S", 0.2)
    monkeypatch.setattr(pool_client, "LAST_RETRY_S", 0.4)
    store = start_store(address)
    client = PoolClient(address, NAMESPACE, SLOT)
    try:
        assert client.call(Lookup((b"k",))) == Found(0)
        first_id = client.store_id
        os.killpg(store.pid, signal.SIGKILL)
        store.wait(10)
        started = time.monotonic()
        assert client.call(Lookup((b"k",))) is None
        assert client.call(Lookup((b"k",))) is None
        assert time.monotonic() - started < 1
        store = start_store(address)
        wait_for(lambda: client.call(Lookup((b"k",))) is not None, 10, "the new store found")
        assert client.store_id != first_id
    finally:
        stop_group(store.pid, process=store)


def test_a_hung_store_costs_one_call_deadline_then_calls_return_at_once(store, address):
    client = PoolClient(address, NAMESPACE, SLOT)
    assert client.call(Lookup((b"k",))) == Found(0)
    os.kill(store.pid, signal.SIGSTOP)
    try:  # stopped once the kernel says so (a busy host delivers the signal later)
        wait_for(lambda: process_state(store.pid) == "T", 5, "the store to stop")
        started = time.monotonic()
        assert client.call(Lookup((b"k",))) is None
        assert time.monotonic() - started < 2 * pool_client.CALL_TIMEOUT_S
        started = time.monotonic()
        for _ in range(20):  # within the back-off: no call waits on the store again
            assert client.call(Lookup((b"k",))) is None
        assert time.monotonic() - started < 0.1
    finally:
        os.kill(store.pid, signal.SIGCONT)
    # and it stops on SIGTERM with a client still connected (a client's thread took the signal
    # once, leaving the main thread in accept() until SIGKILL 20 s later)
    assert stop_group(store.pid, grace_s=5.0, process=store)


def test_an_observer_gets_the_figures_and_no_memory(store, address):
    observer = PoolClient(address, namespace=None)
    assert observer.call(GetStats()).slots == 0  # no worker has said what the pool holds
    worker = PoolClient(address, NAMESPACE, SLOT)
    worker.call(PrepareStore((b"k",)))
    worker.call(CompleteStore((b"k",), success=True))
    stats = observer.call(GetStats())
    assert (stats.slots, stats.used, stats.bytes) == (4, 1, SLOT)
    assert observer.memory is None


def test_an_observer_may_not_change_the_index(store, address):
    observer, worker = PoolClient(address, namespace=None), PoolClient(address, NAMESPACE, SLOT)
    worker.call(PrepareStore((b"k",)))
    worker.call(CompleteStore((b"k",), success=True))
    assert observer.call(Drop((b"k",))) is None  # refused: the observer's connection is closed
    assert worker.call(Lookup((b"k",))) == Found(1)


def test_an_observer_follows_the_contents_as_changes_after_what_it_has(store, address):
    """What the routers' copies of a pool are built from (router/workers/kv_pool_contents.py)."""
    observer, worker = PoolClient(address, namespace=None), PoolClient(address, NAMESPACE, SLOT)
    for key in (b"k1", b"k2"):
        assert worker.call(PrepareStore((key,))).stored.keys == (key,)
        assert worker.call(CompleteStore((key,), success=True)) == Done()
    first = observer.call(GetContents(store_id="", since=0))
    assert first.changes.reset and set(first.changes.added) == {b"k1", b"k2"}
    worker.call(Drop((b"k1",)))
    worker.call(PrepareStore((b"k3",)))
    worker.call(CompleteStore((b"k3",), success=True))
    changes = observer.call(GetContents(first.store_id, since=first.changes.sequence))
    assert changes.changes == Changes(first.changes.sequence + 2, False, (b"k3",), (b"k1",))
    other = observer.call(GetContents("another store", since=changes.changes.sequence))
    assert other.changes.reset and set(other.changes.added) == {b"k2", b"k3"}


def test_a_workers_contents_source_relays_the_stores_changes(store, address):
    """pdserve/worker/pool_contents.py: what the routers get of the store's contents."""
    worker = PoolClient(address, NAMESPACE, SLOT)
    worker.call(PrepareStore((b"k1", b"k2")))
    worker.call(CompleteStore((b"k1", b"k2"), success=True))
    source = PoolContentsSource(address, block_size=128, none_hash=b"first parent")
    try:
        first = source.changes("", since=0)
        assert (first.store_id, first.reset) == (worker.store_id, True)
        assert set(first.added) == {b"k1", b"k2"}
        assert (first.block_size, first.none_hash) == (128, b"first parent")
        worker.call(Drop((b"k1",)))
        later = source.changes(first.store_id, first.sequence)
        assert (later.reset, list(later.added), list(later.removed)) == (False, [], [b"k1"])
    finally:
        source.client.close()


def test_no_client_can_resize_the_memory_and_an_absurd_slot_size_is_refused(address):
    store = start_store(address, budget=1 << 30)
    try:
        assert PoolClient(address, "tiny slots", 1).call(Lookup((b"k",))) is None  # 2^30 slots
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(socket_address(address))
            raw.sendall(encode(Hello(NAMESPACE, SLOT)))
            _, (fd,), _, _ = socket.recv_fds(raw, HELLO_BYTES, 1)
            try:
                with pytest.raises(PermissionError):  # sealed: a shrink faults others' reads
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
    finally:
        stop_group(store.pid, process=store)


GARBAGE = [
    b"not json",
    b"\xff\xfe",
    b"[1, 2]",
    b'{"op": "evict everything"}',
    b'{"op": "lookup"}',
    b'{"op": "lookup", "keys": ["not hex"]}',
    b'{"op": "lookup", "keys": "6b"}',
    b'{"op": "complete_store", "keys": [], "success": 1}',
    b'{"op": "lookup", "keys": [], "and": "more"}',
    b'{"op": "hello", "namespace": null}',
    b'{"error": "a reply, not a request"}',
    b"[" * 100_000,
]


def test_garbage_gets_an_error_answer_and_the_store_serves_on(store, address):
    """Each line that is no request is answered with an error, on the same connection, which
    then still gets its answers; a connection whose first line is no hello is refused."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(10)
        raw.connect(socket_address(address))
        raw.sendall(encode(Hello(NAMESPACE, SLOT)))
        _, fds, _, _ = socket.recv_fds(raw, HELLO_BYTES, 1)
        for fd in fds:
            os.close(fd)
        answers = raw.makefile("rb")
        for line in GARBAGE:
            raw.sendall(line + b"\n")
            assert set(json.loads(answers.readline())) == {"error", "later"}, line
        raw.sendall(encode(Lookup((b"k",))))
        assert json.loads(answers.readline()) == {"blocks": 0}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(10)
        raw.connect(socket_address(address))
        raw.sendall(encode(Lookup((b"k",))))  # no hello first
        assert "error" in json.loads(raw.makefile("rb").readline())
    assert store.poll() is None
    assert PoolClient(address, NAMESPACE, SLOT).call(Lookup((b"k",))) == Found(0)


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
