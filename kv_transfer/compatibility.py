"""The compatibility handshake: raw KV blocks only mean the same thing to two engines whose
model, dtype, block size, layers, KV heads, head size, wire layout and vLLM version all match.
Tensor parallelism need not: each side re-shards the heads (kv_transfer/head_shards.py), and
the cache layouts need not either: KV travels in one wire order (kv_transfer/kv_layout.py)."""

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from pdserve.settings.cluster_secret import secret_matches


@dataclass(frozen=True)
class Compatibility:
    model: str
    dtype: str
    block_size: int
    num_layers: int
    total_kv_heads: int  # over all tensor-parallel ranks
    head_size: int
    kv_layout: str  # the wire order, kv_layout.WIRE_LAYOUT
    vllm_version: str

    @classmethod
    def from_message(cls, message) -> "Compatibility":
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """Short and equal exactly when every field is: what workers publish in Health, so the
        router pairs only workers whose handshake would succeed."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def mismatches(producer: Compatibility, consumer: Compatibility) -> list[str]:
    """Each field that differs, as 'field: producer X != consumer Y'."""
    return [
        f"{f.name}: producer {getattr(producer, f.name)!r} != consumer "
        f"{getattr(consumer, f.name)!r}"
        for f in fields(Compatibility)
        if getattr(producer, f.name) != getattr(consumer, f.name)
    ]


REFUSAL_PREFIX = "incompatible KV"


def describe_refusal(producer: Compatibility, consumer: Compatibility) -> str:
    return f"{REFUSAL_PREFIX} layout, refused: " + "; ".join(mismatches(producer, consumer))


NO_HELLO = "a KV stream must start with hello"
NO_SECRET = "refused: the KV stream did not carry this cluster's secret"


def check_hello(message, consumer: Compatibility, secret: str) -> str:
    """What a receiver with cluster secret `secret` says to a stream's first message: "" to
    accept it, else why it is refused (every receiver, whatever the transport, answers the
    same)."""
    if message is None or not message.HasField("hello"):
        return NO_HELLO
    if not secret_matches(message.hello.cluster_secret, secret):
        return NO_SECRET
    producer = Compatibility.from_message(message.hello)
    return describe_refusal(producer, consumer) if mismatches(producer, consumer) else ""
