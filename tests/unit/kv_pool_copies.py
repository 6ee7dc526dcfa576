"""What the KV pool copy tests share (test_kv_pool_sync.py, test_kv_pool_batched.py): caches as
vLLM allocates them, a pool memory over an anonymous map, and `count`, a fixture counting what a
copy dispatches to torch (copy launches, device syncs)."""

import mmap
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kv_transfer.pool.copy import PoolMemory, cache_rows
from kv_transfer.pool.store import header_bytes

PAGE = 2048  # one block's bytes of one layer
# The dispatcher's names of what copies bytes (one launch each on a device).
COPIES = {
    "copy_",
    "index_select",
    "index_copy_",
    "index_put_",
    "cat",
    "stack",
    "_to_copy",
    "clone",
    "where",
    "gather",
    "scatter",
    "constant_pad_nd",
}
SYNC = "_local_scalar_dense"  # .item(), int(), float(), bool() of a tensor: a device sync
MOST_COPIES = 8  # a job's copy launches, whatever its blocks and layers (one slot run)


@dataclass
class Calls:
    syncs: int  # synchronising calls
    copies: int  # copy launches
    ops: int  # every dispatched op
    detail: dict

    def __str__(self) -> str:
        copies = {name: n for name, n in self.detail.items() if name in COPIES}
        return f"{self.syncs} sync(s), {self.copies} copy launch(es) {copies}, {self.ops} ops"


class Dispatched(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count(monkeypatch):
    """count(run) -> (run's result, Calls): what `run` dispatched, and the explicit syncs."""
    explicit: Counter = Counter()

    def counting(name, original):
        def counted(*args, **kwargs):
            explicit[name] += 1
            return original(*args, **kwargs)

        return counted

    monkeypatch.setattr(torch.Tensor, "item", counting("item", torch.Tensor.item))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("cuda", torch.cuda.synchronize))
    for owner in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(owner, "synchronize", counting(owner.__name__, owner.synchronize))

    def run_counted(run):
        explicit.clear()
        with Dispatched() as dispatched:
            result = run()
        syncs = dispatched.ops[SYNC] + explicit["cuda"] + explicit["Event"] + explicit["Stream"]
        syncs += explicit["item"] if not dispatched.ops[SYNC] else 0  # item() dispatches SYNC
        copies = sum(n for name, n in dispatched.ops.items() if name in COPIES)
        total = sum(dispatched.ops.values())
        return result, Calls(syncs, copies, total, dict(dispatched.ops) | dict(explicit))

    return run_counted


def vllm_cache(blocks: int, layers: int, cross_layer: bool = False) -> list[torch.Tensor]:
    """Cache tensors as vLLM 0.32 allocates them: one int8 buffer, each layer a (blocks, page)
    view of it, layer by layer (LB*) or block by block (BL*, cross-layer), random bytes."""
    buffer = torch.randint(-128, 128, (layers * blocks * PAGE,), dtype=torch.int8)
    if cross_layer:
        per_block = buffer.view(blocks, layers, PAGE)
        return [cache_rows(per_block[:, layer]) for layer in range(layers)]
    return [cache_rows(layer.view(blocks, PAGE)) for layer in buffer.view(layers, -1)]


def pool(slots: int, slot_bytes: int, parts: int = 1) -> PoolMemory:
    start = header_bytes(slots, parts)
    return PoolMemory.over(mmap.mmap(-1, start + slots * slot_bytes), start, slots, parts)


def keys_for(blocks: int) -> list[bytes]:
    return [f"key {i}".encode() for i in range(blocks)]


def block_bytes(pages: list[torch.Tensor], block: int) -> torch.Tensor:
    return torch.cat([page[block] for page in pages])
