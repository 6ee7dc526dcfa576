"""Moving wire tensors between a device and host memory without stalling the forward pass.

Send (`DeviceToHost`): on CUDA the gather and the device->host copy run on a side stream that
first waits for the forward stream (so the layer's KV is written), into a pinned host buffer
from a bounded pool; an event marks the copy done, and the sender thread waits on that event,
never the forward thread. `fence()` makes the forward stream wait for the side stream (a GPU-side
wait, no host sync), so blocks freed after the request are not rewritten before they are copied.
For a transport that sends device memory (nccl on CUDA) the gathered tensor stays on the device.
On CPU the gathered tensor is the host tensor: no staging, no copy beyond the gather.
Whatever is staged and not yet sent counts against one budget (`pool_bytes`): when it is spent
the forward pass waits for the sender, up to POOL_WAIT_S, then the slice is given up.
The pinned buffers are carved out of memory pinned once (`PinnedArena`, made with the sender),
so the pinned footprint is the budget: torch's own host allocator keeps every buffer it ever
pinned, by power-of-two size, and a pool of per-size buffers grew to the sum of the peaks.

Receive (`HostToDevice`): on CUDA the host->device copies and scatters run on a side stream,
queued from vLLM's thread without ever waiting there: receive buffers are pinned
(`receive_buffer`, given to the receiver's inbox) and so is each block index, so every copy is
asynchronous (a copy from pageable memory blocks the calling thread, here behind the forward
pass the side stream waits for); a pageable slice (a lent shared-memory segment) is first
copied into pinned memory. Receive buffers and those copies come from a `PinnedArena` of the
inbox's size, made on first use (what the inbox lets in never needs more; a buffer it cannot
place is pinned beside it, counted in `pinned_stats()`). A transfer is reported loaded once an
event recorded after its last scatter has passed (`mark()`, `passed()`: an event query, never
a stream synchronize), i.e. before vLLM schedules the request; or, for KV loaded in the step
that schedules its request, the forward stream is made to wait for the side stream
(`precede_forward()`, a GPU-side wait). Every tensor a queued scatter
reads is held until an event after it has passed. On CPU the scatter happens at once, and
nothing is pinned (there is no CUDA to pin for).

The host KV pool's copies (kv_transfer/pool/copy.py) use the same side stream, with two more
pieces: `CudaSideStream.precede_forward()` (a fence the other way, before vLLM reuses blocks a
queued copy still reads), and `HostRegistration`, which registers memory torch did not allocate
(the pool's shared mapping) with CUDA as pinned, so its copies are asynchronous too.

Plain torch: no vLLM import.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.kv_copy import as_bytes
from kv_transfer.memory_budget import INBOX_BYTES

POOL_WAIT_S = 10.0  # longest a sender waits for pinned memory before giving up on a slice


class StagingError(RuntimeError):
    """No pinned memory came free in time."""


class ByteBudget:
    """At most `max_bytes` held at once; `acquire` waits for room (a slice larger than the
    whole budget is refused at once)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.in_use = 0
        self.lock = threading.Condition(threading.RLock())

    def acquire(self, nbytes: int, timeout_s: float = POOL_WAIT_S) -> None:
        if nbytes > self.max_bytes:
            raise StagingError(f"a {nbytes}-byte slice is larger than the KV send buffer")
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.in_use + nbytes > self.max_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingError(f"the KV send buffer stayed full for {timeout_s:g} s")
                self.lock.wait(left)
            self.in_use += nbytes

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.in_use -= nbytes
            self.lock.notify_all()


ARENA_ALIGN = 4096  # what a PinnedArena buffer's size is rounded up to
ARENA_MIN_BLOCK = 1 << 20  # smallest block an arena pins (its capacity's remainder is left out)


class PinnedArena:
    """Host buffers carved out of pinned blocks made once, `capacity` bytes in all, handed out
    first-fit and merged back when given back: the memory pinned never exceeds `capacity`
    whatever sizes come and go (torch's host allocator keeps each buffer it pinned for reuse
    at its power-of-two size, for ever). The blocks are powers of two (what that allocator
    pins for them exactly), the capacity's binary digits down to ARENA_MIN_BLOCK, made on the
    first `take` or on `reserve()`. `pin=False` (no CUDA) carves ordinary memory: the same
    bookkeeping, for tests. Thread-safe."""

    def __init__(self, capacity: int, pin: bool = True) -> None:
        self.capacity = capacity
        self.pin = pin
        sizes = [
            1 << bit for bit in range(capacity.bit_length() - 1, -1, -1) if capacity >> bit & 1
        ]
        self.sizes = [size for size in sizes if size >= ARENA_MIN_BLOCK] or [
            max(ARENA_ALIGN, capacity - capacity % ARENA_ALIGN)
        ]
        self.largest = self.sizes[0]
        self.blocks: list[torch.Tensor] = []
        self.free: list[list[tuple[int, int]]] = []  # per block: (start, size), by start
        self.lent: dict[int, tuple[int, int, int]] = {}  # data_ptr -> (block, start, size)
        self.lock = threading.Lock()
        self.in_use = 0
        self.peak = 0

    def reserve(self) -> None:
        """Pin the blocks now (a worker's start), not on the first `take`."""
        with self.lock:
            self._make()

    def _make(self) -> None:
        if not self.blocks:
            for size in self.sizes:
                self.blocks.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
                self.free.append([(0, size)])

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes` (a view into a block), or None when no free
        range holds it now."""
        size = max(ARENA_ALIGN, -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN)
        with self.lock:
            self._make()
            for index, ranges in enumerate(self.free):
                for at, (start, length) in enumerate(ranges):
                    if length < size:
                        continue
                    if length == size:
                        del ranges[at]
                    else:
                        ranges[at] = (start + size, length - size)
                    buffer = self.blocks[index][start : start + size]
                    self.lent[buffer.data_ptr()] = (index, start, size)
                    self.in_use += size
                    self.peak = max(self.peak, self.in_use)
                    return buffer
        return None

    def give(self, buffer: torch.Tensor) -> bool:
        """Take back a buffer `take` gave; False for any other (left alone)."""
        with self.lock:
            found = self.lent.pop(buffer.data_ptr(), None)
            if found is None:
                return False
            index, start, size = found
            ranges = self.free[index]
            at = next((i for i, (s, _) in enumerate(ranges) if s > start), len(ranges))
            ranges.insert(at, (start, size))
            if at + 1 < len(ranges) and start + size == ranges[at + 1][0]:  # merge the next
                ranges[at] = (start, size + ranges.pop(at + 1)[1])
            if at and ranges[at - 1][0] + ranges[at - 1][1] == start:  # and the previous
                before = ranges.pop(at - 1)
                ranges[at - 1] = (before[0], before[1] + ranges[at - 1][1])
            self.in_use -= size
            return True

    def pinned_bytes(self) -> int:
        """What it holds pinned: its blocks, once made."""
        return sum(self.sizes) if self.blocks else 0


class PinnedPool(ByteBudget):
    """Pinned host buffers for staged slices, out of one PinnedArena of `max_bytes`: what is
    pinned is the budget, never more; `acquire` waits for a free range that holds the slice."""

    def __init__(self, max_bytes: int, pin: bool = True) -> None:
        super().__init__(max_bytes)
        self.arena = PinnedArena(max_bytes, pin)

    def acquire(self, nbytes: int, timeout_s: float = POOL_WAIT_S) -> torch.Tensor:
        if nbytes > self.arena.largest:
            raise StagingError(
                f"a {nbytes}-byte slice is larger than the KV send buffer's largest block "
                f"({self.arena.largest} bytes)"
            )
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while (buffer := self.arena.take(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingError(f"the KV send buffer stayed full for {timeout_s:g} s")
                self.lock.wait(left)
            self.in_use += buffer.numel()
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self.lock:
            if self.arena.give(buffer):
                self.in_use -= buffer.numel()
            self.lock.notify_all()


@dataclass
class Staged:
    """A wire tensor on its way out: `ready()` waits for the staging copy and gives the bytes
    as a flat uint8 tensor (on the host, or on the device for a device transport); `release()`
    returns its memory to the budget once the bytes are sent."""

    tensor: torch.Tensor  # the wire tensor, or the pinned buffer holding it
    nbytes: int
    event: object = None
    on_release: Callable[[torch.Tensor], None] | None = None

    def ready(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.reshape(-1).view(torch.uint8)[: self.nbytes]

    def release(self) -> None:
        if self.on_release is not None:
            self.on_release(self.tensor)
            self.on_release = None


class DeviceToHost:
    def __init__(self, device: torch.device, pool_bytes: int) -> None:
        """`pool_bytes`: the KV staged and not yet sent it may hold (the worker setting
        `kv_send_buffer_mib`): pinned host memory on CUDA."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = PinnedPool(pool_bytes) if self.cuda else None
        if self.pool is not None:
            self.pool.arena.reserve()  # pinned now (the worker's start), not on vLLM's thread
        self.budget = ByteBudget(pool_bytes)  # what is not in the pinned pool

    def stage(self, gather: Callable[[], torch.Tensor], to_host: bool = True) -> Staged:
        """Run `gather()` (which reads the cache) and, unless `to_host` is false, copy its
        result to the host, off the forward stream on CUDA."""
        if not self.cuda:
            return self._budgeted(gather())
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            wire = gather()
            if not to_host:  # sent from the device: done once the side stream gets here
                staged = self._budgeted(wire)
                staged.event = torch.cuda.Event(blocking=True)
                staged.event.record(self.stream)
                return staged
            nbytes = wire.numel() * wire.element_size()
            buffer = self.pool.acquire(nbytes)
            buffer[:nbytes].copy_(wire.reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the sender thread sleeps, not spins
            event.record(self.stream)
        return Staged(buffer, nbytes, event, self.pool.release)

    def _budgeted(self, wire: torch.Tensor) -> Staged:
        nbytes = wire.numel() * wire.element_size()
        self.budget.acquire(nbytes)
        return Staged(wire, nbytes, on_release=lambda _: self.budget.release(nbytes))

    def fence(self) -> None:
        """The forward stream waits (on the GPU) for every copy staged so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def pinned_stats(self) -> dict[str, int]:
        """Pinned host memory: held (the arena, the budget's size, on CUDA), in use, peak."""
        arena = self.pool.arena if self.pool is not None else None
        return {
            "pinned_bytes": arena.pinned_bytes() if arena else 0,
            "pinned_in_use": arena.in_use if arena else 0,
            "pinned_peak": arena.peak if arena else 0,
        }


class CudaSideStream:
    """A CUDA stream of its own for the decode side's copies and scatters (what HostToDevice
    drives; a test drives a fake with the same four calls)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def follow_forward(self) -> None:
        """Later work here waits (on the GPU) for what the forward stream has queued."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def submit(self, work: Callable[[], object]) -> None:
        """Queue `work`'s kernels on this stream."""
        with torch.cuda.stream(self.stream):
            work()

    def record(self):
        """An event this stream passes once everything queued so far has run."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()

    def precede_forward(self) -> None:
        """Later work on the forward stream waits (on the GPU) for what this stream has queued:
        a fence, no host wait (before vLLM reuses blocks a queued copy still reads)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class HostRegistration:
    """Host memory torch did not allocate (a shared mapping: the KV pool's) registered with CUDA
    as pinned, so copies between it and `device` are asynchronous DMA: a copy from or to
    pageable memory makes the calling thread wait until it is done, i.e. behind whatever the
    stream has queued first.

    `pieces`: (address, bytes) ranges registered one by one (cudaHostRegister has a size limit;
    a caller keeps every copy within one piece). The calls run on a thread of their own, which
    sets `device` first (so no context is made on GPU 0 for another rank's device) and whose
    failed call's error stays in that thread (CUDA's last error is per thread: left on vLLM's,
    the next kernel launch check there would raise it). `wait`: return once registered (at an
    engine's start); else `ready` turns true when it is done, and copies stage through pinned
    memory until then. Registering pins every page: the whole range becomes resident.
    `release()` unregisters; the caller first makes sure no queued copy still touches it.
    `owner` (the mapping's tensors) is kept alive as long as the registration is."""

    def __init__(self, pieces: list[tuple[int, int]], device, owner=None, wait: bool = True):
        self.pieces = pieces
        self.device = torch.device(device)
        self.owner = owner
        self.registered: list[int] = []
        self.ok = False
        self.error = ""
        self.seconds = 0.0
        self.done = threading.Event()
        self._thread = threading.Thread(
            target=self._register, name="pdserve-host-register", daemon=True
        )
        self._thread.start()
        if wait:
            self._thread.join()

    @property
    def ready(self) -> bool:
        """Registered, every piece of it (False while registering, or if it failed)."""
        return self.done.is_set() and self.ok

    def _register(self) -> None:
        started = time.perf_counter()
        try:
            torch.cuda.set_device(self.device)
            cudart = torch.cuda.cudart()
            for address, size in self.pieces:
                code = int(cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))
                if code != 0:
                    self.error = f"cudaHostRegister of {size} B: CUDA error {code}"
                    break
                self.registered.append(address)
            else:
                self.ok = True
        except Exception as error:  # no CUDA runtime: copies stay staged, as before
            self.error = f"{type(error).__name__}: {error}"
        finally:
            if not self.ok:
                self._unregister()
            self.seconds = time.perf_counter() - started
            self.done.set()

    def _unregister(self) -> None:
        addresses, self.registered = self.registered, []
        if not addresses:
            return
        cudart = torch.cuda.cudart()
        for address in reversed(addresses):
            cudart.cudaHostUnregister(address)

    def release(self, wait: bool = True) -> None:
        """Unregister, once every copy that touches it is done (the caller's to know), on a
        thread of its own as registering (`wait`: until it is done); the memory's owner is let
        go after."""
        self._thread.join()
        self.ok = False
        thread = threading.Thread(target=self._release, name="pdserve-host-unregister")
        thread.start()
        if wait:
            thread.join()

    def _release(self) -> None:
        try:
            if self.registered:
                torch.cuda.set_device(self.device)
                self._unregister()
        finally:
            self.owner = None


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class HostToDevice:
    """The decode side's loads: copy a wire tensor and its block index to the device and scatter
    them into the cache, on a side stream on CUDA (at once on CPU).

    Lifetimes: a kernel queued on the side stream reads its tensors later, and a tensor freed
    meanwhile goes back to the caching allocator, which hands it to the next allocation of its
    stream (the next layer's receive, the forward pass): that one could overwrite it before the
    scatter reads it, a silent corruption. So every tensor a load reads (the received buffer, a
    pinned copy of it, the index, their device copies) and the slice's release (which lends its
    buffer to the next receive) are held until an event recorded after the load has passed:
    `release_after(release)` once per slice, `collect()` each engine step (event queries, no
    wait); `mark()` then `passed(mark)` before reporting a transfer loaded. vLLM's thread never
    waits for the device here: `wait()` (a stream synchronize) is for tools, not the loader."""

    def __init__(
        self, device: torch.device, side_stream=None, receive_bytes: int = INBOX_BYTES
    ) -> None:
        """`receive_bytes`: the pinned memory of receive buffers (the inbox's size)."""
        self.device = device
        if side_stream is None and device.type == "cuda":
            side_stream = CudaSideStream(device)
        self.side = side_stream  # None on CPU: loads run at once
        self.stream = getattr(side_stream, "stream", None)  # its torch.cuda.Stream, on CUDA
        self.pin = device.type == "cuda"  # pinned host memory exists only beside CUDA
        self.held: list = []  # tensors read by loads submitted since the last release_after
        self.in_flight: list[tuple[object, list, Callable[[], None]]] = []  # (event, held, release)
        self.arena = PinnedArena(receive_bytes) if self.pin else None  # made on first use
        self.lent: dict[int, torch.Tensor] = {}  # id(receive buffer) -> the memory under it
        self.given: list[torch.Tensor] = []  # pinned copies to give back at the next release
        self.outside = 0  # bytes pinned beside the arena (what it could not place), now
        self.outside_peak = 0
        self.lock = threading.Lock()

    def receive_buffer(self, size: int):
        """A buffer for a slice being received (the inbox's `new_buffer`): pinned host memory
        beside CUDA, from the arena, so its copy to the device needs no staging; a bytearray
        otherwise. `free_receive_buffer` gives it back."""
        if not self.pin:
            return bytearray(size)
        memory = self._pinned(size)
        buffer = as_bytes(memory[:size])
        with self.lock:
            self.lent[id(buffer)] = memory
        return buffer

    def free_receive_buffer(self, buffer) -> bool:
        """Give back a buffer `receive_buffer` made (the inbox's `free_buffer`); False for any
        other."""
        with self.lock:
            memory = self.lent.pop(id(buffer), None)
        if memory is None:
            return False
        self._give(memory)
        return True

    def _pinned(self, size: int) -> torch.Tensor:
        memory = self.arena.take(size)
        if memory is None:  # no free range holds it: pinned beside, counted
            memory = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            with self.lock:
                self.outside += size
                self.outside_peak = max(self.outside_peak, self.outside)
        return memory

    def _give(self, memory: torch.Tensor) -> None:
        if not self.arena.give(memory):
            with self.lock:
                self.outside -= memory.numel()

    def pinned_stats(self) -> dict[str, int]:
        """Pinned host memory for receiving: held (the arena, once made, and what was pinned
        beside it), in use, peaks."""
        if self.arena is None:
            return {"pinned_bytes": 0, "pinned_in_use": 0, "pinned_peak": 0}
        with self.lock:
            outside, outside_peak = self.outside, self.outside_peak
        return {
            "pinned_bytes": self.arena.pinned_bytes() + outside,
            "pinned_in_use": self.arena.in_use + outside,
            "pinned_peak": self.arena.peak + outside_peak,
        }

    def index(self, block_ids: list[int]) -> torch.Tensor:
        """A block index on the host, pinned beside CUDA (its copy is then asynchronous)."""
        return torch.tensor(block_ids, dtype=torch.long, pin_memory=self.pin)

    def load(
        self,
        host_wire: torch.Tensor,
        host_index: torch.Tensor | None,
        write: Callable[[torch.Tensor, torch.Tensor | None], None],
    ) -> None:
        """Bring the wire tensor (on the host, or already on the device) and its block index
        (from `index()`; None for a copy that needs none) to the device and `write(wire, index)`
        them into the cache."""
        if self.side is None:
            write(host_wire, host_index)
            return
        # After what the forward stream has queued: vLLM may zero newly allocated blocks, or a
        # finished request's last step may still write into a block just handed to this one.
        self.side.follow_forward()
        source, held = host_wire, [t for t in (host_wire, host_index) if t is not None]
        if source.device.type == "cpu" and self.pin and not source.is_pinned():
            memory = self._pinned(source.numel() * source.element_size())
            size = source.numel() * source.element_size()
            source = memory[:size].view(source.dtype).view(source.shape).copy_(source)  # memcpy
            held.append(source)
            self.given.append(memory)  # back to the arena with the slice's release

        def work() -> None:
            wire = source.to(self.device, non_blocking=True)
            index = None if host_index is None else host_index.to(self.device, non_blocking=True)
            held.extend(t for t in (wire, index) if t is not None)
            write(wire, index)

        self.side.submit(work)
        self.held.extend(held)

    def release_after(self, release: Callable[[], None]) -> None:
        """Run `release` once the loads submitted so far have passed (at once on CPU)."""
        if self.side is None:
            release()
            return
        given, self.given = self.given, []
        if given:  # pinned copies this slice's loads read: back to the arena after them too
            release = self._giving_back(release, given)
        self.in_flight.append((self.side.record(), self.held, release))
        self.held = []

    def _giving_back(self, release: Callable[[], None], given: list) -> Callable[[], None]:
        def both() -> None:
            try:
                release()
            finally:
                for memory in given:
                    self._give(memory)

        return both

    def collect(self) -> None:
        """Release what the side stream is done with (its events are in stream order)."""
        while self.in_flight and self.in_flight[0][0].query():
            _, _, release = self.in_flight.pop(0)
            release()

    def precede_forward(self) -> None:
        """The forward stream's later work waits (on the GPU) for every load submitted so far:
        KV loaded in the step that computes from it (nothing to wait for on CPU)."""
        if self.side is not None:
            self.side.precede_forward()

    def mark(self):
        """Something `passed()` once every load submitted so far has landed (None on CPU)."""
        return None if self.side is None else self.side.record()

    @staticmethod
    def passed(mark) -> bool:
        """Whether the loads before `mark` have landed: an event query, never a wait."""
        return mark is None or mark.query()

    def wait(self) -> None:
        """Every load so far has landed (a stream synchronize: for tools and tests; the loader
        polls `passed()` instead)."""
        if self.side is None:
            return
        self.side.synchronize()
        in_flight, self.in_flight = self.in_flight, []
        for _, _, release in in_flight:
            release()
