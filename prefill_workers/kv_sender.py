"""The prefill worker's per-layer KV sender (worker side, one per tensor-parallel rank).

Right after a layer's forward, `save_layer` stages that layer's blocks of each request being
sent (on CUDA: gathered and copied to pinned host memory on a side stream; the forward stream
is never synchronised) and queues them for the transport's sender thread, so the transfer of
layer i overlaps the compute of layers i+1... With the decode pool at another tensor-parallel
size, each decode rank gets from this rank the heads the head routes give it (split or merged
on the head dimension).

Each slice carries its transfer's epoch and its sequence number among the slices this rank sends
that decode rank for the transfer (0, 1, ... in sending order: step by step, layer by layer), so
the receiver refuses a duplicated, reordered or stale one (kv_transfer/integrity.py).
"""

import logging
from collections import OrderedDict

import torch

from kv_transfer.grpc_transport import rank_address
from kv_transfer.head_shards import head_routes, rank_heads
from kv_transfer.host_staging import DeviceToHost, StagingError
from kv_transfer.integrity import transfer_epoch
from kv_transfer.kv_copy import gather
from kv_transfer.kv_layout import LayerLayout
from kv_transfer.metadata import SendSlice
from kv_transfer.transfer_report import Cancel, Failure
from kv_transfer.transport import KvSender, LayerSlice
from pdserve.core.kinds import Transport

log = logging.getLogger("pdserve.kv")
MAX_SEQUENCES = 4096  # transfers whose sequence numbers are kept (a finished one is dropped)


class LayerSender:
    def __init__(
        self,
        sender: KvSender,
        layout: LayerLayout,
        head_size: int,
        total_heads: int,
        tp: int,
        rank: int,
        device: torch.device,
        send_buffer_bytes: int,
    ) -> None:
        self.sender = sender
        self.layout = layout
        self.head_size = head_size
        self.total_heads = total_heads
        self.tp = tp
        self.rank = rank
        self.own_heads = rank_heads(total_heads, tp, rank)
        self.device = device
        self.staging = DeviceToHost(device, send_buffer_bytes)
        self.indexes: dict[int, torch.Tensor] = {}  # id(SendSlice) -> block ids on the device
        self.given_up: set[str] = set()  # transfers cancelled: not staged again
        # (transfer id, decode rank) -> the next slice's sequence number
        self.sequences: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.finishing: set[str] = set()  # transfers whose last step was sent

    def new_step(self, sends: list[SendSlice]) -> None:
        """The block-id tensors of the last step are not needed any more; a given-up transfer
        is forgotten once no step sends it (its request finished)."""
        self.indexes.clear()
        self.given_up &= {piece.transfer_id for piece in sends}
        for key in [key for key in self.sequences if key[0] in self.finishing]:
            del self.sequences[key]
        self.finishing = {piece.transfer_id for piece in sends if piece.last}

    def save_layer(self, layer: int, kv_layer: torch.Tensor, sends: list[SendSlice]) -> None:
        canonical = self.layout.canonical(kv_layer, self.head_size)
        for piece in sends:
            if piece.transfer_id in self.given_up:
                continue
            block_ids = self._index(piece)
            for route in head_routes(self.total_heads, self.tp, piece.decode_tp):
                if route.prefill_rank != self.rank:
                    continue
                start = route.first_head - self.own_heads.start
                heads = slice(start, start + route.num_heads)
                destination = rank_address(piece.destination, route.decode_rank)
                try:
                    staged = self.staging.stage(
                        lambda ids=block_ids, heads=heads: gather(canonical, ids, heads),
                        to_host=piece.transport != Transport.NCCL,  # NCCL sends from the device
                    )
                except StagingError as error:  # the sender is far behind: give this one up
                    log.error("KV transfer %s: %s; cancelling it", piece.transfer_id, error)
                    self.given_up.add(piece.transfer_id)
                    for decode_rank in range(piece.decode_tp):
                        self.sender.cancel(
                            rank_address(piece.destination, decode_rank),
                            piece.transfer_id,
                            Cancel(Failure.CANCELLED, f"prefill worker: {error}"),
                        )
                    break
                self.sender.send(
                    destination,
                    piece.transport,
                    LayerSlice(
                        piece.transfer_id,
                        layer,
                        piece.first_block,
                        len(piece.block_ids),
                        route.first_head,
                        route.num_heads,
                        staged,
                        piece.last,
                        epoch=transfer_epoch(piece.transfer_id),
                        seq=self._next_seq(piece.transfer_id, route.decode_rank),
                    ),
                )

    def _next_seq(self, transfer_id: str, decode_rank: int) -> int:
        key = (transfer_id, decode_rank)
        seq = self.sequences.pop(key, 0)
        self.sequences[key] = seq + 1
        while len(self.sequences) > MAX_SEQUENCES:  # their requests were aborted
            self.sequences.popitem(last=False)
        return seq

    def _index(self, piece: SendSlice) -> torch.Tensor:
        """The slice's block ids on the cache's device, made once per step (every layer uses
        them); on CUDA through pinned memory, so the copy does not synchronise."""
        index = self.indexes.get(id(piece))
        if index is None:
            index = torch.tensor(piece.block_ids, dtype=torch.long)
            if self.device.type == "cuda":
                index = index.pin_memory().to(self.device, non_blocking=True)
            self.indexes[id(piece)] = index
        return index

    def fence(self) -> None:
        """End of the forward pass: later GPU work waits for this step's copies."""
        self.staging.fence()

    def close(self) -> None:
        self.sender.close()
