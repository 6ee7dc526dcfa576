"""A worker's connection to its host's KV pool (kv_transfer/pool/store.py): the index's answers
and the pool's memory, mapped into this process.

The pool is an optimisation, never a dependency: every call has a deadline, and a store that
is gone, slow or refusing makes a call return None (the caller computes what it would have
loaded, or skips a store). A failed store is asked again after a back-off (1 s, doubling to
30 s); a new store has a new `store_id` and new memory, and what was planned against the old one
is refused (a load names the store it was planned against).
"""

import logging
import mmap
import os
import socket
import struct
import threading
import time

from kv_transfer.pool.wire import (
    HELLO_BYTES,
    GetStats,
    Hello,
    Joined,
    Observing,
    PoolRequest,
    PoolStats,
    Refused,
    Reply,
    decode,
    encode,
    socket_address,
)

log = logging.getLogger("pdserve.kv")

CALL_TIMEOUT_S = 0.5  # the store answers in microseconds; past this it is treated as gone
FIRST_RETRY_S = 1.0  # after a failure, the next try; doubled after each failure in a row
LAST_RETRY_S = 30.0


class PoolClient:
    """A worker's engine's connection (`namespace`: what its blocks are; `parts`: its
    tensor-parallel ranks, each writing its part of every slot), a peer's (namespace PEER:
    whatever the pool holds, kv_transfer/pool/peer.py), or an observer's (namespace None: stats
    only, no memory). Its calls run on vLLM's scheduler and model threads, so none
    waits longer than CALL_TIMEOUT_S, and a store that failed (gone, hung, refusing) is tried
    again only after a back-off."""

    def __init__(self, address: str, namespace: str | None, slot_bytes: int = 0, parts: int = 1):
        self.address = address
        self.namespace = namespace
        self.slot_bytes = slot_bytes
        self.parts = parts
        self.store_id: str | None = None
        self.pool_namespace = ""  # what the store holds (a peer's namespace is PEER: any)
        self.slots = 0
        self.header_bytes = 0
        self.memory: mmap.mmap | None = None
        self._sock: socket.socket | None = None
        self._stream = None
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._retry_s = FIRST_RETRY_S
        self._refused = False

    def call(self, request: PoolRequest[Reply]) -> Reply | None:
        """The store's answer to one request, or None (no store, or it failed to answer)."""
        with self._lock:
            if not self._connected():
                return None
            try:
                self._sock.sendall(encode(request))
                answer = decode(self._stream.readline(), request.reply)
            except (OSError, ValueError) as error:  # a WireError is a ValueError
                self._failed(f"{request.op}: {error}")
                return None
            if isinstance(answer, Refused):
                self._failed(f"{request.op}: {answer.error}")
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CALL_TIMEOUT_S)
        fds: list[int] = []
        try:
            sock.connect(socket_address(self.address))
            _check_peer(sock)
            sock.sendall(encode(Hello(self.namespace, self.slot_bytes, self.parts)))
            data, fds, _flags, _addr = socket.recv_fds(sock, HELLO_BYTES, 1)
            reply = decode(data, Joined if self.namespace is not None else Observing)
            if isinstance(reply, Observing):
                self._sock, self._stream = sock, sock.makefile("rb")
                return True
            if isinstance(reply, Refused) and reply.later:  # a peer, before any engine
                raise ValueError(reply.error)
            if not fds or isinstance(reply, Refused):
                self._refused = True  # a namespace the store does not hold: it will not change
                log.warning("kv pool at %s refused this worker: %s", self.address, reply)
                sock.close()
                return False
            memory = mmap.mmap(fds[0], reply.header_bytes + reply.slots * reply.slot_bytes)
            # a peer's are the pool's
            self.slot_bytes, self.parts = reply.slot_bytes, reply.parts
            self.pool_namespace = reply.namespace
        except (OSError, ValueError) as error:  # a WireError is a ValueError
            sock.close()
            self._backoff()
            log.debug("kv pool at %s: not reachable (%s)", self.address, error)
            return False
        finally:
            for fd in fds:
                os.close(fd)
        self.memory = memory  # an old store's mapping goes with the last view of it
        self.store_id, self.slots, self.header_bytes = (
            reply.store_id,
            reply.slots,
            reply.header_bytes,
        )
        self._sock, self._stream = sock, sock.makefile("rb")
        self._retry_s = FIRST_RETRY_S
        log.info("kv pool at %s: %d slots of %d B", self.address, self.slots, self.slot_bytes)
        return True

    def _failed(self, why: str) -> None:
        log.warning("kv pool at %s: lost (%s); computing without it", self.address, why)
        self._close()
        self._backoff()

    def _backoff(self) -> None:
        self._next_try = time.monotonic() + self._retry_s
        self._retry_s = min(LAST_RETRY_S, 2 * self._retry_s)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._stream = None

    def close(self) -> None:
        with self._lock:
            self._close()


def store_stats(address: str) -> PoolStats | None:
    """The figures of the store at `address` (an observer's one question), or None when it
    does not answer within the call deadline (a hung store's socket still takes connections)."""
    client = PoolClient(address, namespace=None)
    try:
        return client.call(GetStats())
    finally:
        client.close()


def _check_peer(sock: socket.socket) -> None:
    """The store runs as this process's user (an abstract socket's name is visible to every
    local user, who could bind it once the store is gone): else OSError."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise OSError(f"the socket's owner is uid {uid}, not this process's {os.getuid()}")
