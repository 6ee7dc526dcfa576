"""What `--kv-fault KIND:RATE` asks for (a testing aid: kv_transfer/faults.py damages the slices
it sends). Free of pydantic, as the KV data plane that reads it must be."""

from dataclasses import dataclass
from enum import StrEnum


class KvFaultKind(StrEnum):
    """What `--kv-fault` does to a slice (kv_transfer/faults.py)."""

    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    STALE = "stale"
    DELAY = "delay"


@dataclass(frozen=True)
class KvFault:
    kind: KvFaultKind
    rate: float  # the fraction of slices it hits, in [0, 1]


def parse_kv_fault(text: str) -> KvFault | None:
    """ "KIND:RATE" -> a KvFault; "" -> None; ValueError saying what is wrong."""
    if not text:
        return None
    kind, _, rate = text.partition(":")
    if kind not in set(KvFaultKind):
        raise ValueError(f"{text!r}: KIND must be one of {', '.join(KvFaultKind)}")
    try:
        value = float(rate)
    except ValueError:
        raise ValueError(f"{text!r}: RATE must be a number from 0 to 1") from None
    if not 0 <= value <= 1:
        raise ValueError(f"{text!r}: RATE must be from 0 to 1")
    return KvFault(KvFaultKind(kind), value)
