"""KV through shared memory, between a prefill and a decode worker on one host.

The sender writes each chunk of a slice into one of a small pool of shared-memory segments and
sends the chunk's KvChunk (which segment, how many bytes) on a Unix socket. A slice that fits in
one segment is lent to the KV loader as it is, and the segment is freed once the loader has
copied it into the cache (one copy on each side, the fewest possible); otherwise, or when half
the segments are already lent, the receiver copies the bytes out and frees the segment at once,
so both processes copy at the same time on different segments. At most SEGMENTS segments of
SEGMENT_BYTES per channel: a receiver that stops reading stops the sender.

Nothing can be left behind in /dev/shm: a segment is a memfd (anonymous, never named in a
file system), passed to the receiver over the socket with SCM_RIGHTS the first time it is used,
and the socket is an abstract one (Linux: no file either). Both vanish with the last process
holding them, on completion, cancel, timeout or death alike.

The receiver listens at "\\0pdserve-kv:<host>:<port>", the address the sender was given, so a
sender reaches it only from the same host and network namespace (the router's `auto` choice
checks that with transport.host_id).

An abstract socket's name is open to every process in the network namespace, whatever its user,
and any of them could bind it while the receiver is down. So each end checks that the other runs
as its own user (SO_PEERCRED) before it says anything: the sender before its hello (which
carries the cluster secret), the receiver at accept. Before a hello is accepted the receiver
bounds what the peer can hold: HELLO_WAIT_S to send it, frames of MAX_FRAME_BYTES, no file
descriptor kept (one sent before the hello refuses the connection), MAX_CONNECTIONS at once.
After it, a segment must be a sealed memfd of SEGMENT_BYTES (it cannot shrink under a reader).
"""

import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from google.protobuf.message import DecodeError

from kv_transfer import kv_wire_pb2 as wire
from kv_transfer.compatibility import Compatibility, check_hello
from kv_transfer.grpc_transport import hello, slice_chunk
from kv_transfer.kv_copy import as_bytes
from kv_transfer.log_limit import LogLimit
from kv_transfer.transport import ChannelError, Inbox, LayerSlice, Refused, SliceAssembler

log = logging.getLogger("pdserve.kv")

SEGMENT_BYTES = 8 << 20
SEGMENTS = 8  # per channel: 64 MiB of shared memory at most
WAIT_S = 30.0  # longest a sender waits for a free segment or a reply (the receiver's inbox may
# hold it up to transport.INBOX_WAIT_S)
HELLO_WAIT_S = 2.0  # longest a connected peer may take to send its hello
MAX_FRAME_BYTES = 64 << 10  # every message is small: a chunk's bytes are in its segment
MAX_CONNECTIONS = 48  # connected senders at once (each has a thread)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_LENGTH = struct.Struct("<I")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(address: str) -> str:
    return f"\0pdserve-kv:{address}"


def peer_uid(sock: socket.socket) -> int:
    """The user the process at the other end of a connected Unix socket runs as."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return _CREDENTIALS.unpack(creds)[1]


def check_peer(sock: socket.socket) -> None:
    """ChannelError unless the peer runs as this process's user."""
    uid = peer_uid(sock)
    if uid != os.getuid():
        raise ChannelError(f"the peer runs as uid {uid}, not as this process's {os.getuid()}")


def send_frame(sock: socket.socket, message, fds: tuple[int, ...] = ()) -> None:
    data = message.SerializeToString()
    frame = _LENGTH.pack(len(data)) + data
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else 0
    if sent < len(frame):  # nothing left to send: no send (a peer gone since would raise EPIPE)
        sock.sendall(frame[sent:])


class FrameReader:
    """Length-prefixed messages from a Unix socket, and the file descriptors sent with them
    (in the order they were sent). A frame above MAX_FRAME_BYTES fails the read (ChannelError)
    before its bytes are awaited. At most `max_fds` descriptors are kept until taken: any other
    is closed as it comes (counted in `dropped_fds`), and fails the read."""

    def __init__(self, sock: socket.socket, max_fds: int = 0) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.fds: deque[int] = deque()
        self.max_fds = max_fds
        self.dropped_fds = 0

    def read(self, timeout_s: float | None) -> bytes | None:
        """The next frame; None at end of stream; socket.timeout if none came in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if len(self.buffer) >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(self.buffer)
                if size > MAX_FRAME_BYTES:
                    raise ChannelError(f"a {size}-byte frame (at most {MAX_FRAME_BYTES})")
                end = _LENGTH.size + size
                if len(self.buffer) >= end:
                    frame = bytes(self.buffer[_LENGTH.size : end])
                    del self.buffer[:end]
                    return frame
            self.sock.settimeout(
                None if deadline is None else max(0.0, deadline - time.monotonic())
            )
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            self._keep(fds)
            if not data:
                return None
            self.buffer += data

    def _keep(self, fds: list[int]) -> None:
        dropped = 0
        for fd in fds:
            if len(self.fds) < self.max_fds:
                self.fds.append(fd)
            else:
                os.close(fd)
                dropped += 1
        if dropped:
            self.dropped_fds += dropped
            if self.max_fds:  # past what a sender can have in flight
                raise ChannelError(f"more than {self.max_fds} file descriptors not yet used")

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


class Segment:
    def __init__(self) -> None:
        self.fd = os.memfd_create("pdserve-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, SEGMENT_BYTES)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # the receiver checks them
            self.map = mmap.mmap(self.fd, SEGMENT_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self.shared = False  # its descriptor has reached the receiver

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class ShmChannel:
    def __init__(self, destination: str, compatibility: Compatibility) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.segments: list[Segment] = []
        self.free: list[int] = []
        try:
            self.sock.settimeout(WAIT_S)
            self.sock.connect(socket_name(destination))
            check_peer(self.sock)  # whoever holds the name hears the secret: our user only
        except OSError as error:
            self.sock.close()
            raise ChannelError(
                f"no shared-memory KV receiver for {destination} on this host ({error})"
            ) from None
        except ChannelError as error:
            self.sock.close()
            raise ChannelError(f"the shm KV receiver for {destination}: {error}") from None
        self.reader = FrameReader(self.sock)  # a receiver sends no descriptors
        try:
            send_frame(self.sock, hello(compatibility))
            reply = self._reply(WAIT_S)
        except (OSError, ChannelError, DecodeError) as error:
            self.close()
            raise ChannelError(f"shm handshake with {destination}: {error}") from None
        if reply is None or not reply.handshake.accepted:
            self.close()
            raise Refused(reply.handshake.error if reply else "the receiver closed the socket")

    def _reply(self, timeout_s: float | None) -> wire.ShmReply | None:
        frame = self.reader.read(timeout_s)
        return None if frame is None else wire.ShmReply.FromString(frame)

    def send(self, piece: LayerSlice) -> None:
        memory = as_bytes(piece.data.ready())
        total = len(memory)
        try:
            for offset in range(0, max(total, 1), SEGMENT_BYTES):
                length = min(SEGMENT_BYTES, total - offset)
                index = self._free_segment()
                segment = self.segments[index]
                segment.map[:length] = memory[offset : offset + length]
                chunk = slice_chunk(piece, offset, length)
                chunk.segment = index
                self.sock.settimeout(WAIT_S)
                send_frame(
                    self.sock, wire.KvMessage(chunk=chunk), () if segment.shared else (segment.fd,)
                )
                segment.shared = True
        except OSError as error:
            raise ChannelError(f"shm channel: {error}") from None

    def _free_segment(self) -> int:
        """A segment the receiver is done with; a new one while the pool has room; else wait."""
        self._collect(0.0)
        if not self.free and len(self.segments) < SEGMENTS:
            self.segments.append(Segment())
            return len(self.segments) - 1
        deadline = time.monotonic() + WAIT_S
        while not self.free:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelError(f"the receiver freed no shared memory for {WAIT_S:g} s")
            self._collect(left)
        return self.free.pop()

    def _collect(self, timeout_s: float) -> None:
        """Read the receiver's replies for up to `timeout_s` (0: those already here)."""
        while True:
            try:
                reply = self._reply(timeout_s)
            except (TimeoutError, BlockingIOError):
                return
            if reply is None:
                raise ChannelError("the receiver closed the shared-memory channel")
            if reply.free_segment >= len(self.segments) or reply.free_segment in self.free:
                raise ChannelError(f"the receiver freed segment {reply.free_segment}, not lent")
            self.free.append(reply.free_segment)
            timeout_s = 0.0

    def close(self) -> None:
        try:
            self.sock.settimeout(1.0)
            send_frame(self.sock, wire.KvMessage(bye=True))
        except OSError:
            pass  # the receiver is gone: nothing to tell
        self.sock.close()
        self.reader.close()
        for segment in self.segments:
            segment.close()
        self.segments.clear()


class Replies:
    """The receiver's side of one connection: "segment free" replies, sent by its thread after
    a copy, or by the KV loader's thread when it releases a slice lent straight from a segment.
    At most half the segments are lent at once, so a loader that lags (a slice waiting for its
    request) never starves the sender: the other chunks are copied out and freed at once."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.lock = threading.Lock()
        self.lent = 0
        self.closed = False

    def may_lend(self) -> bool:
        with self.lock:
            return self.lent < SEGMENTS // 2

    def lend(self, segment: int):
        """The release callback of a slice lent from `segment`."""
        with self.lock:
            self.lent += 1

        def release() -> None:
            with self.lock:
                self.lent -= 1
            self.free(segment)

        return release

    def free(self, segment: int) -> None:
        with self.lock:
            if self.closed:
                return
            try:
                send_frame(self.connection, wire.ShmReply(free_segment=segment))
            except OSError:  # the sender is gone; the connection's thread will notice
                pass

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.connection.close()


class ShmListener:
    """The receiving end: one thread per connected sender, MAX_CONNECTIONS at most."""

    def __init__(
        self,
        address: str,
        compatibility: Compatibility,
        secret: str,
        inbox: Inbox,
        bind: Callable[[], None] = lambda: None,
    ) -> None:
        """`bind()`: called first in each connection's thread (binds the rank's CUDA device:
        its pinned receive buffers are CUDA calls)."""
        self.address = address
        self.bind = bind
        self.compatibility = compatibility
        self.secret = secret
        self.inbox = inbox
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.accepting = threading.Thread(target=self._accept, name="kv-shm-accept", daemon=True)
        self.refusals = LogLimit(log)

    def start(self) -> None:
        self.sock.bind(socket_name(self.address))
        self.sock.listen(64)
        self.accepting.start()

    def stop(self) -> None:
        """Unbinds the name before returning, so a new listener can take the same address.

        A bare close() would not: the kernel keeps a socket that a thread is blocked on in
        accept() or recv(), so shutdown() first wakes those threads."""
        for sock in [self.sock, *self.connections_now()]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # never connected, or already shut
                pass
        if self.accepting.is_alive():
            self.accepting.join(WAIT_S)
        self.sock.close()
        for connection in self.connections_now():
            connection.close()

    def connections_now(self) -> list[socket.socket]:
        with self.lock:
            return list(self.connections)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:  # stopped
                return
            try:
                check_peer(connection)
            except (OSError, ChannelError) as error:
                self.refusals.error("shm-peer", "shm KV connection refused: %s", error)
                connection.close()
                continue
            with self.lock:
                full = len(self.connections) >= MAX_CONNECTIONS
                if not full:
                    self.connections.add(connection)
            if full:
                self.refusals.error(
                    "shm-connections",
                    "shm KV connection refused: %d senders connected already",
                    MAX_CONNECTIONS,
                )
                connection.close()
                continue
            threading.Thread(
                target=self._serve, args=(connection,), name="kv-shm-receive", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        reader = FrameReader(connection)  # keeps no descriptor before the hello
        replies = Replies(connection)
        maps: dict[int, mmap.mmap] = {}
        assembler = SliceAssembler(self.inbox, "shm", self.compatibility)
        clean = False
        ended = "the prefill worker's shm KV channel ended mid-stream"
        try:
            self.bind()
            if not self._hello(connection, reader):
                return
            reader.max_fds = SEGMENTS  # a sender's segments, each sent once
            while (frame := reader.read(None)) is not None:
                message = wire.KvMessage.FromString(frame)
                if message.HasField("bye"):
                    clean = True
                    break
                chunk = message.chunk
                if chunk.segment >= SEGMENTS or chunk.length > SEGMENT_BYTES:
                    raise ChannelError(
                        f"{chunk.length} bytes in segment {chunk.segment}: a sender has "
                        f"{SEGMENTS} of {SEGMENT_BYTES} bytes"
                    )
                if chunk.segment not in maps:
                    maps[chunk.segment] = _map_segment(reader.fds.popleft())
                view = memoryview(maps[chunk.segment])[: chunk.length]
                if chunk.length == chunk.slice_bytes and replies.may_lend():
                    # The whole slice in one segment: the loader reads it there, and frees it.
                    assembler.deliver(chunk, view, replies.lend(chunk.segment))
                    continue
                with view:
                    assembler.add(chunk, view)
                replies.free(chunk.segment)
        except Exception as error:  # whatever it was, the stream's transfers are cancelled
            log.error("shm KV channel failed: %s", error)
            ended = f"the prefill worker's shm KV channel failed: {error}"
        finally:
            if not clean:
                assembler.abandon(ended)
            replies.close()
            for mapped in maps.values():
                try:
                    mapped.close()
                except BufferError:  # a lent slice not loaded yet: unmapped once it is dropped
                    pass
            reader.close()
            with self.lock:
                self.connections.discard(connection)

    def _hello(self, connection: socket.socket, reader: FrameReader) -> bool:
        """Read and answer the hello, within HELLO_WAIT_S: whether it was accepted."""
        try:
            frame = reader.read(HELLO_WAIT_S)
        except (OSError, ChannelError) as error:  # TimeoutError is an OSError
            self.refusals.error("shm-hello", "shm KV connection with no hello: %s", error)
            return False
        if frame is None:
            return False
        if reader.dropped_fds:
            error = f"{reader.dropped_fds} file descriptors sent before the hello"
        else:
            try:
                message = wire.KvMessage.FromString(frame)
            except DecodeError:
                message = None
            error = check_hello(message, self.compatibility, self.secret)
        if error:
            self.refusals.error("shm-refused", "shm KV hello refused: %s", error)
        reply = wire.PushKvReply(accepted=not error, error=error)
        send_frame(connection, wire.ShmReply(handshake=reply))
        return not error


def _map_segment(fd: int) -> mmap.mmap:
    """Map a segment the sender passed (and close its descriptor): a memfd of SEGMENT_BYTES,
    sealed against shrinking (a sender that shrank it would crash this process on a read)."""
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise ChannelError("a segment not sealed against shrinking")
        size = os.fstat(fd).st_size
        if size != SEGMENT_BYTES:
            raise ChannelError(f"a segment of {size} bytes, not {SEGMENT_BYTES}")
        return mmap.mmap(fd, SEGMENT_BYTES)
    finally:
        os.close(fd)
