"""A worker's connection to its host's KV pool (kv_transfer/pool_store.py): the index's answers
and the pool's memory, mapped into this process.

The pool is an optimisation, never a dependency: every call has a deadline, and a store that
is gone, slow or refusing makes a call return None (the caller computes what it would have
loaded, or skips a store). A lost store is asked again at most every RECONNECT_S; a new store
has a new `store_id` and new memory, and what was prepared against the old one is refused by
the reader's check (a load names the store it was planned against).
"""

import json
import logging
import mmap
import os
import socket
import threading
import time

from kv_transfer.pool_store import HELLO_BYTES, socket_address

log = logging.getLogger("pdserve.kv")

CALL_TIMEOUT_S = 2.0  # the store answers in microseconds; past this it is treated as gone
RECONNECT_S = 1.0


class PoolClient:
    """A worker's engine's connection (`namespace`: what its blocks are), or an observer's
    (namespace None: stats only, no memory)."""

    def __init__(self, address: str, namespace: str | None, slot_bytes: int = 0):
        self.address = address
        self.namespace = namespace
        self.slot_bytes = slot_bytes
        self.store_id: str | None = None
        self.slots = 0
        self.header_bytes = 0
        self.memory: mmap.mmap | None = None
        self._sock: socket.socket | None = None
        self._stream = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._refused = False

    def call(self, op: str, keys: list[bytes] = (), **fields) -> dict | None:
        """The store's answer to one request, or None (no store, or it failed to answer)."""
        with self._lock:
            if not self._connected():
                return None
            line = json.dumps({"op": op, "keys": [key.hex() for key in keys], **fields}) + "\n"
            try:
                self._sock.sendall(line.encode())
                answer = json.loads(self._stream.readline() or "null")
            except (OSError, ValueError) as error:
                self._disconnect(f"{op}: {error}")
                return None
            if not isinstance(answer, dict) or "error" in answer:
                self._disconnect(f"{op}: {answer}")
                return None
            return answer

    def connected(self) -> bool:
        """Connected to a store now (connecting if it is time to try)."""
        with self._lock:
            return self._connected()

    def _connected(self) -> bool:
        if self._sock is not None:
            return True
        if self._refused or time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + RECONNECT_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CALL_TIMEOUT_S)
        try:
            sock.connect(socket_address(self.address))
            hello = {"op": "hello", "namespace": self.namespace, "slot_bytes": self.slot_bytes}
            sock.sendall((json.dumps(hello) + "\n").encode())
            data, fds, _flags, _addr = socket.recv_fds(sock, HELLO_BYTES, 1)
            reply = json.loads(data.decode() or "null")
        except (OSError, ValueError) as error:
            sock.close()
            log.debug("kv pool at %s: not reachable (%s)", self.address, error)
            return False
        if self.namespace is None and reply == {}:
            self._sock, self._stream = sock, sock.makefile("rb")
            return True
        if not fds or not isinstance(reply, dict) or "error" in reply:
            for fd in fds:
                os.close(fd)
            sock.close()
            self._refused = True  # a namespace the store does not hold: it will not change
            log.warning("kv pool at %s refused this worker: %s", self.address, reply)
            return False
        (fd,) = fds
        try:
            size = reply["header_bytes"] + reply["slots"] * reply["slot_bytes"]
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.memory = memory  # an old store's mapping goes with the last view of it
        self.store_id, self.slots = reply["store_id"], reply["slots"]
        self.header_bytes = reply["header_bytes"]
        self._sock, self._stream = sock, sock.makefile("rb")
        log.info("kv pool at %s: %d slots of %d B", self.address, self.slots, self.slot_bytes)
        return True

    def _disconnect(self, why: str) -> None:
        log.warning("kv pool at %s: lost (%s); computing without it", self.address, why)
        try:
            self._sock.close()
        finally:
            self._sock = self._stream = None

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = self._stream = None
