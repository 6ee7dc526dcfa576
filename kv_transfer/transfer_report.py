"""What a decode rank reports of one finished KV transfer, and why one failed.

The decode connector's worker half reports each transfer once (decode_workers/kv_loader.py);
the report rides vLLM's connector stats (kv_transfer/stats.py) to the worker's process, where a
tensor-parallel worker's ranks' reports of a transfer are merged into the transfer's
(pdserve/worker/engine_stats.py). vLLM needs plain data where its stats cross into that
process: `to_data` and `from_data` are the only conversions.
"""

from dataclasses import dataclass, replace
from enum import StrEnum

from kv_transfer.integrity import Damage
from pdserve.core.kinds import KV_NOT_HELD

TRANSFERS = "transfers"  # the key of the reports in vLLM's connector stats, and in their data


class Failure(StrEnum):
    """Why a transfer failed (the metrics' `failure` label and the router's KvTransferStats)."""

    TIMEOUT = "timeout"  # nothing, or not all of it, came before its deadline (or its load)
    CANCELLED = "cancelled"  # its sender failed, or the router ended it
    REFUSED = "refused"  # its sender's handshake was refused (incompatible KV)
    INTEGRITY = "integrity"  # a slice failed its integrity check (the report's `damage`)
    NOT_HELD = KV_NOT_HELD  # this worker lacked the prefix blocks the sender skipped


@dataclass(frozen=True)
class Cancel:
    """Word that a transfer will not complete (kv_transfer/transport.py's Inbox keeps it)."""

    failure: Failure
    reason: str  # for the log


@dataclass(frozen=True)
class TransferReport:
    """One finished transfer, as one rank saw it (or the whole transfer, its ranks merged)."""

    transfer_id: str
    bytes: int = 0
    seconds: float = 0.0  # first slice received -> last slice received (or the failure)
    failure: Failure | None = None  # None: loaded (or its request aborted)
    damage: Damage | None = None  # what failed the integrity check, if one did
    transports: frozenset[str] = frozenset()  # what carried its slices (kinds.Transport)
    pinned_bytes: int | None = None  # beside CUDA: the rank's pinned receive memory
    in_step: bool = False  # loaded in the engine step that scheduled its request

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def transport(self) -> str:
        """What carried it, as one label: "grpc", "grpc,shm"; "" when no slice came."""
        return ",".join(sorted(self.transports))

    def merged(self, other: "TransferReport") -> "TransferReport":
        """Two ranks' reports of one transfer as the transfer's: bytes and pinned memory summed,
        the longer time, the first failure and damage, every transport; loaded in its request's
        step when every rank's was."""
        pinned = [r.pinned_bytes for r in (self, other) if r.pinned_bytes is not None]
        return replace(
            self,
            bytes=self.bytes + other.bytes,
            seconds=max(self.seconds, other.seconds),
            failure=self.failure or other.failure,
            damage=self.damage or other.damage,
            transports=self.transports | other.transports,
            pinned_bytes=sum(pinned) if pinned else None,
            in_step=self.in_step and other.in_step,
        )

    def to_data(self) -> dict:
        """Plain data (str, int, float, list, None), as vLLM's stats carry it across processes."""
        return {
            "transfer_id": self.transfer_id,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "failure": None if self.failure is None else str(self.failure),
            "damage": None if self.damage is None else str(self.damage),
            "transports": sorted(self.transports),
            "pinned_bytes": self.pinned_bytes,
            "in_step": self.in_step,
        }

    @classmethod
    def from_data(cls, data: dict) -> "TransferReport":
        return cls(
            transfer_id=data["transfer_id"],
            bytes=data["bytes"],
            seconds=data["seconds"],
            failure=Failure(data["failure"]) if data["failure"] else None,
            damage=Damage(data["damage"]) if data["damage"] else None,
            transports=frozenset(data["transports"]),
            pinned_bytes=data["pinned_bytes"],
            in_step=data["in_step"],
        )
