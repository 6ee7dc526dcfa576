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

Protocol: JSON lines. The hello's answer comes with the memory's descriptor: {"slots",
"slot_bytes", "parts", "header_bytes", "store_id", "namespace"}; a hello without a namespace is
an observer's (a worker's /metrics and Stats), which gets no memory and may only ask for "stats" or
"contents" (the keys that became loadable or stopped being loadable since a change number:
routers keep a copy of what the pool holds). Then each request {"op", ...} gets one answer line;
keys travel in hex. The memory: a header of HEADER_BYTES_PER_PART per part of every slot (its
writer's key tag and digest, which a reader checks: kv_transfer/pool/copy.py), then the slots,
page-aligned.
"""

import argparse
import fcntl
import json
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
from kv_transfer.pool.wire import PEER, socket_address

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

    def hello(self, namespace: str, slot_bytes: int, parts: int = 1) -> dict:
        """The first client's namespace, slot size and parts per slot make the memory; later
        ones must match. A peer (namespace PEER: the worker's process that copies blocks
        between this pool and another host's) takes whatever this pool holds, once a worker's
        engine said what that is."""
        with self.lock:
            if namespace == PEER:
                if self.namespace is None:
                    return {"error": "no worker's engine joined this pool yet", "later": True}
                namespace, slot_bytes, parts = self.namespace, self.slot_bytes, self.parts
            if self.namespace is None:
                slots = self.budget_bytes // max(1, slot_bytes)
                if not 1 <= slots <= MAX_SLOTS or slot_bytes < 1:
                    return {
                        "error": f"a budget of {self.budget_bytes} B in {slot_bytes} B blocks: "
                        f"{slots} slots, not 1 to {MAX_SLOTS}"
                    }
                if not 1 <= parts <= MAX_PARTS or slot_bytes % parts:
                    return {"error": f"{slot_bytes} B slots in {parts} parts"}
                self.fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(self.fd, header_bytes(slots, parts) + slots * slot_bytes)
                # No client may resize it (a shrink would fault every other client's reads).
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
                self.namespace, self.slot_bytes, self.parts = namespace, slot_bytes, parts
                self.index = PoolIndex(slots)
            elif (namespace, slot_bytes, parts) != (self.namespace, self.slot_bytes, self.parts):
                return {
                    "error": f"this store holds {self.namespace} in {self.slot_bytes} B blocks "
                    f"of {self.parts} parts, not {namespace} in {slot_bytes} B of {parts}"
                }
            self._owners += 1
            return {
                "owner": self._owners,
                "slots": self.index.slots,
                "slot_bytes": self.slot_bytes,
                "parts": self.parts,
                "header_bytes": header_bytes(self.index.slots, self.parts),
                "store_id": self.store_id,
                "namespace": self.namespace,
            }

    def answer(self, request: dict, owner: int) -> dict:
        keys = [bytes.fromhex(key) for key in request.get("keys", ())]
        op = request.get("op")
        with self.lock:
            index = self.index
            if op == "lookup":
                return {"found": index.lookup(keys)}
            if op == "prepare_load":
                return {"slots": index.prepare_load(keys, owner)}
            if op == "complete_load":
                index.complete_load(keys, owner)
            elif op == "prepare_store":
                stored = index.prepare_store(keys, owner)
                if stored is None:
                    return {"stored": None}
                return {
                    "stored": {
                        "keys": [key.hex() for key in stored.keys],
                        "slots": stored.slots,
                        "evicted": [key.hex() for key in stored.evicted],
                    }
                }
            elif op == "complete_store":
                index.complete_store(keys, owner, bool(request.get("success")))
            elif op == "drop":
                index.drop(keys)
            elif op == "stats":
                return self._stats()
            else:
                return {"error": f"unknown op {op!r}"}
            return {}

    def observe(self, request: dict) -> dict:
        """An observer's question: the figures, or (op "contents") what the pool holds."""
        with self.lock:
            return self._contents(request) if request.get("op") == "contents" else self._stats()

    def _contents(self, request: dict) -> dict:
        """The loadable keys added and removed since change number `since` of the store
        `store_id` (every loadable key when that is another store's, or too far back)."""
        index = self.index or PoolIndex(0)
        since = int(request.get("since", 0)) if request.get("store_id") == self.store_id else -1
        changes = index.contents_since(since)
        return {
            "store_id": self.store_id,
            "sequence": changes["sequence"],
            "reset": changes["reset"],
            "added": [key.hex() for key in changes["added"]],
            "removed": [key.hex() for key in changes["removed"]],
        }

    def _stats(self) -> dict:
        """The pool's figures; zeros before its first worker said what it holds."""
        index = self.index or PoolIndex(0)
        return {
            "namespace": self.namespace,
            "budget_bytes": self.budget_bytes,
            "slots": index.slots,
            "used": index.used,
            "slot_bytes": self.slot_bytes,
            "bytes": index.used * self.slot_bytes,
            "hits": index.hits,
            "evictions": index.evictions,
            "dropped": index.dropped,
        }

    def release(self, owner: int) -> None:
        with self.lock:
            if self.index is not None:
                self.index.release_owner(owner)

    def serve_client(self, conn: socket.socket) -> None:
        owner = None
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            if uid != os.getuid():
                return
            stream = conn.makefile("rb")
            hello = json.loads(stream.readline() or "null")
            if not isinstance(hello, dict) or hello.get("op") != "hello":
                return
            if hello.get("namespace") is None:  # an observer (a worker's /metrics, Stats)
                conn.sendall(b"{}\n")
                for raw in stream:
                    conn.sendall((json.dumps(self.observe(json.loads(raw))) + "\n").encode())
                return
            reply = self.hello(
                str(hello["namespace"]), int(hello.get("slot_bytes", 0)), int(hello.get("parts", 1))
            )
            line = (json.dumps(reply) + "\n").encode()
            if "error" in reply:
                conn.sendall(line)
                return
            owner = reply["owner"]
            socket.send_fds(conn, [line], [self.fd])
            for raw in stream:
                answer = self.answer(json.loads(raw), owner)
                conn.sendall((json.dumps(answer) + "\n").encode())
        except (OSError, ValueError):
            pass  # the client went away, or spoke nonsense: its holdings are released below
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
