"""The sending side's channel factory: one place that maps a transport's name to its channel."""

import torch

from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import GrpcChannel, cancel_transfer
from kv_transfer.nccl_transport import NcclChannel
from kv_transfer.shm_transport import ShmChannel
from kv_transfer.transport import Channel, KvSender, OpenChannel
from pdserve.core.kinds import Transport


def channel_opener(compatibility: Compatibility, host: str, device: torch.device) -> OpenChannel:
    """`open(kind, destination)` for a prefill rank whose KV is on `device`, reachable at
    `host` (where an nccl channel's rendezvous listens)."""

    def open_channel(kind: Transport, destination: str) -> Channel:
        if kind == Transport.GRPC:
            return GrpcChannel(destination, compatibility)
        if kind == Transport.SHM:
            return ShmChannel(destination, compatibility)
        if kind == Transport.NCCL:
            return NcclChannel(destination, compatibility, host, device)
        raise ValueError(f"unknown KV transport {kind!r}")

    return open_channel


def kv_sender(
    compatibility: Compatibility, host: str, device: torch.device, integrity: bool = True
) -> KvSender:
    """`integrity`: every slice sent carries its digest (kv_transfer/integrity.py)."""
    return KvSender(
        channel_opener(compatibility, host, device),
        cancel_transfer,
        integrity=integrity,
        num_layers=compatibility.num_layers,
        device=device,
    )
