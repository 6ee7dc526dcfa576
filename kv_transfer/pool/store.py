"""The host KV pool: one process per host holding KV blocks that any worker of the host computed,
so that another worker (or the same one, after its engine evicted them) loads them instead of
computing them again.

    python -m kv_transfer.pool.store --address @pdserve-kv-pool-1234 --budget-bytes 1073741824

The blocks live in one anonymous shared-memory file (memfd, sealed against resizing): the store
hands its descriptor to each client over a Unix socket (SCM_RIGHTS), and the clients copy KV in
and out of it directly; the socket carries only the index's questions (pdserve's
kv_transfer/pool/index.py answers them). The memory has no name in /dev/shm or on disk: it is
gone when the store and its last client are, on every path, kill -9 included. An address
starting with "@" is a Linux abstract socket (no file either; `serve` uses one); a path address
is a socket file, removed when the store exits normally. Store and clients check that the other
side runs as the same user, since the blocks are prompts' KV.

A store serves one namespace (the model, its quantization and KV dtype, the block size and cache
layout, the tensor-parallel size, vLLM's block hash seed: kv_transfer/pool/offload.py): the first
client's hello sets it, its slot size and its parts per slot; a client whose namespace differs is
refused, and its pool stays off (it computes everything, as without a pool). A peer's hello
(namespace "*": a worker's own process, copying blocks to or from another host's pool,
kv_transfer/pool/peer.py) takes the namespace the engines set. A slot of a
tensor-parallel engine holds one part per rank (each rank's heads of the block), each with its
own header entry, written and checked by that rank alone.

Protocol (kv_transfer/pool/wire.py): JSON lines, one frozen dataclass per request and per
reply, keys in hex. A connection's first line is a Hello; an engine's or a peer's is answered
with Joined (the memory's layout, store_id, namespace) and the memory's descriptor; one without
a namespace is an observer's (a worker's /metrics and Stats), which gets Observing, no memory,
and may only ask GetStats or GetContents (the keys that became loadable or stopped being
loadable since a change number: routers keep a copy of what the pool holds). Then each request
line gets one reply line, of the type the request names; a line that is no request (not JSON,
an unknown op, a field missing or of the wrong type) gets a Refused, and the store reads on.
The memory: a header of HEADER_BYTES_PER_PART per part of every slot (its writer's key tag and
digest, which a reader checks: kv_transfer/pool/copy.py), then the slots, page-aligned.
"""

import argparse
import fcntl
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import uuid

from kv_transfer.pool.client import store_stats
from kv_transfer.pool.index import PoolIndex
from kv_transfer.pool.wire import (
    PEER,
    CompleteLoad,
    CompleteStore,
    Contents,
    Done,
    Drop,
    Found,
    GetContents,
    GetStats,
    Hello,
    Joined,
    Lookup,
    Observing,
    Pinned,
    PoolRequest,
    PoolStats,
    PrepareLoad,
    PrepareStore,
    Refused,
    Reserved,
    WireError,
    decode,
    encode,
    socket_address,
)

HEADER_BYTES_PER_PART = 16  # key tag (8) and digest (8) of what the writer put there
PAGE = mmap.PAGESIZE
MAX_SLOTS = 1 << 20  # the index's size bound (a 1 TiB pool of 1 MiB blocks)
MAX_PARTS = 64  # tensor-parallel ranks of one engine


def header_bytes(slots: int, parts: int = 1) -> int:
    return -(-slots * parts * HEADER_BYTES_PER_PART // PAGE) * PAGE


def pool_listening(address: str) -> bool:
    """A store accepts connections at `address` (the connection says nothing and closes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(socket_address(address))
        except OSError:
            return False
    return True


class PoolStore:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.store_id = uuid.uuid4().hex
        self.lock = threading.Lock()
        self.namespace: str | None = None
        self.slot_bytes = 0
        self.parts = 1
        self.index: PoolIndex | None = None
        self.fd = -1
        self._owners = 0

    def join(self, hello: Hello) -> Joined | Refused:
        """The first client's namespace, slot size and parts per slot make the memory; later
        ones must match. A peer (namespace PEER: the worker's process that copies blocks
        between this pool and another host's) takes whatever this pool holds, once a worker's
        engine said what that is."""
        namespace, slot_bytes, parts = hello.namespace, hello.slot_bytes, hello.parts
        with self.lock:
            if namespace == PEER:
                if self.namespace is None:
                    return Refused("no worker's engine joined this pool yet", later=True)
                namespace, slot_bytes, parts = self.namespace, self.slot_bytes, self.parts
            if self.namespace is None:
                slots = self.budget_bytes // max(1, slot_bytes)
                if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
                    return Refused(
                        f"a budget of {self.budget_bytes} B in {slot_bytes} B blocks: "
                        f"{slots} slots, not 1 to {MAX_SLOTS}"
                    )
                if not 1 <= parts <= MAX_PARTS or slot_bytes % parts:
                    return Refused(f"{slot_bytes} B slots in {parts} parts")
                self.fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(self.fd, header_bytes(slots, parts) + slots * slot_bytes)
                # No client may resize it (a shrink would fault every other client's reads).
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
                self.namespace, self.slot_bytes, self.parts = namespace, slot_bytes, parts
                self.index = PoolIndex(slots)
            elif (namespace, slot_bytes, parts) != (self.namespace, self.slot_bytes, self.parts):
                return Refused(
                    f"this store holds {self.namespace} in {self.slot_bytes} B blocks "
                    f"of {self.parts} parts, not {namespace} in {slot_bytes} B of {parts}"
                )
            self._owners += 1
            return Joined(
                owner=self._owners,
                slots=self.index.slots,
                slot_bytes=self.slot_bytes,
                parts=self.parts,
                header_bytes=header_bytes(self.index.slots, self.parts),
                store_id=self.store_id,
                namespace=self.namespace,
            )

    def answer(self, request: PoolRequest, owner: int | None):
        """The reply (of the request's `reply` type) to an engine's or a peer's request
        (`owner`: its connection), or an observer's (owner None: stats and contents only)."""
        with self.lock:
            index = self.index
            match request:
                case GetStats():
                    return self._stats()
                case GetContents(store_id, since):
                    since = since if store_id == self.store_id else -1  # another store's: all
                    return Contents(self.store_id, (index or PoolIndex(0)).contents_since(since))
                case _ if owner is None:
                    return Refused(f"an observer asks for stats or contents, not {request.op}")
                case Lookup(keys):
                    return Found(index.lookup(keys))
                case PrepareLoad(keys):
                    return Pinned(index.prepare_load(keys, owner))
                case CompleteLoad(keys):
                    index.complete_load(keys, owner)
                    return Done()
                case PrepareStore(keys):
                    return Reserved(index.prepare_store(keys, owner))
                case CompleteStore(keys, success):
                    index.complete_store(keys, owner, success)
                    return Done()
                case Drop(keys):
                    index.drop(keys)
                    return Done()
            return Refused(f"no answer to {request.op}")

    def _stats(self) -> PoolStats:
        """The pool's figures; zeros before its first worker said what it holds."""
        index = self.index or PoolIndex(0)
        return PoolStats(
            namespace=self.namespace,
            budget_bytes=self.budget_bytes,
            slots=index.slots,
            used=index.used,
            slot_bytes=self.slot_bytes,
            bytes=index.used * self.slot_bytes,
            hits=index.hits,
            evictions=index.evictions,
            dropped=index.dropped,
        )

    def release(self, owner: int) -> None:
        with self.lock:
            if self.index is not None:
                self.index.release_owner(owner)

    def serve_client(self, conn: socket.socket) -> None:
        """One connection: its hello (answered with the memory's descriptor), then one answer
        line per request line; a line that is no request gets a Refused, and the next is read."""
        owner = None
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                return
            stream = conn.makefile("rb")
            try:
                hello = decode(stream.readline(), Hello)
            except WireError as error:
                conn.sendall(encode(Refused(f"no hello: {error}")))
                return
            if hello.namespace is None:  # an observer (a worker's /metrics, Stats)
                conn.sendall(encode(Observing()))
            else:
                reply = self.join(hello)
                if isinstance(reply, Refused):
                    conn.sendall(encode(reply))
                    return
                owner = reply.owner
                socket.send_fds(conn, [encode(reply)], [self.fd])
            for line in stream:
                try:
                    answer = self.answer(decode(line, PoolRequest), owner)
                except WireError as error:
                    answer = Refused(str(error))
                conn.sendall(encode(answer))
        except OSError:
            pass  # the client went away: its holdings are released below
        finally:
            if owner is not None:
                self.release(owner)
            conn.close()


def _start_deaf_to_stop_signals(target, *args) -> None:
    """A client's thread that never takes SIGTERM or SIGINT (it inherits the mask it starts
    with): the kernel hands a process's signal to any thread not blocking it, and one taken by a
    thread in recv() left the main thread in accept(), the store running until SIGKILL."""
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        threading.Thread(target=target, args=args, daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def serve(address: str, budget_bytes: int) -> None:
    store = PoolStore(budget_bytes)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_address(address))
    listener.listen(64)
    print(f"kv pool: {budget_bytes / 2**30:.2f} GiB, listening on {address}", flush=True)
    try:
        while True:
            conn, _ = listener.accept()
            _start_deaf_to_stop_signals(store.serve_client, conn)
    finally:
        listener.close()
        if not address.startswith("@"):
            os.unlink(address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_transfer.pool.store", description=__doc__)
    parser.add_argument("--address", required=True, help="Unix socket: a path, or @name")
    parser.add_argument("--budget-bytes", type=int, help="the pool's memory (to serve)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="serve nothing: exit 0 if the store at --address answers within its call "
        "deadline, 1 if not (a Kubernetes probe)",
    )
    args = parser.parse_args(argv)
    if args.probe:
        return 0 if store_stats(args.address) is not None else 1
    if args.budget_bytes is None:
        parser.error("--budget-bytes is required to serve")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(args.address, args.budget_bytes)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
