"""The sending side's channel factory: one place that maps a transport's name to its channel.

A testing seam: PDSERVE_KV_CHANNEL_WRAPPER, when set to `module:function`, names a function that
wraps the factory (`function(open_channel) -> open_channel`), loaded once when the sender is
made; tests/kv_faults.py damages the slices a running worker sends through it. Unset (the
default, and in production) it costs nothing. Whoever sets a worker's environment can already run
code there, so it opens no new door (docs/security.md).
"""

import importlib
import logging
import os

import torch

from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import GrpcChannel, cancel_transfer
from kv_transfer.nccl_transport import NcclChannel
from kv_transfer.shm_transport import ShmChannel
from kv_transfer.transport import Channel, KvSender, OpenChannel
from pdserve.core.kinds import Transport

CHANNEL_WRAPPER_ENV = "PDSERVE_KV_CHANNEL_WRAPPER"
log = logging.getLogger("pdserve.kv")


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


def wrapped(open_channel: OpenChannel) -> OpenChannel:
    """`open_channel` wrapped by the function CHANNEL_WRAPPER_ENV names, if any (a testing
    seam); a name that does not load fails the sender's start, not a transfer."""
    name = os.environ.get(CHANNEL_WRAPPER_ENV, "")
    if not name:
        return open_channel
    module, _, function = name.partition(":")
    wrap = getattr(importlib.import_module(module), function)
    log.warning("KV channels wrapped by %s (%s: a testing seam)", name, CHANNEL_WRAPPER_ENV)
    return wrap(open_channel)


def kv_sender(
    compatibility: Compatibility, host: str, device: torch.device, integrity: bool = True
) -> KvSender:
    """`integrity`: every slice sent carries its digest (kv_transfer/integrity.py)."""
    return KvSender(
        wrapped(channel_opener(compatibility, host, device)),
        cancel_transfer,
        integrity=integrity,
        num_layers=compatibility.num_layers,
        device=device,
    )
