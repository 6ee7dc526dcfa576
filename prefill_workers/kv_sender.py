"""The prefill worker's per-layer KV sender (worker side, one per tensor-parallel rank).

Right after a layer's forward, `save_layer` copies that layer's blocks of each request being
sent and queues them for the transport's sender thread: the transfer of layer i overlaps the
compute of layers i+1...
"""

import torch

from kv_transfer.grpc_transport import KvSender, LayerSlice, rank_address
from kv_transfer.metadata import SendSlice


class LayerSender:
    def __init__(self, sender: KvSender, rank: int = 0) -> None:
        self.sender = sender
        self.rank = rank  # tensor-parallel rank: sends go to the consumer rank of that number

    def save_layer(self, layer: int, kv_layer: torch.Tensor, sends: list[SendSlice]) -> None:
        for piece in sends:
            blocks = kv_layer[torch.tensor(piece.block_ids, dtype=torch.long)]
            self.sender.send(
                rank_address(piece.destination, self.rank),
                LayerSlice(
                    piece.transfer_id,
                    layer,
                    piece.first_block,
                    len(piece.block_ids),
                    blocks.numpy().tobytes(),
                    piece.last,
                ),
            )

    def close(self) -> None:
        self.sender.close()
