"""The compatibility handshake: raw KV blocks only mean the same thing to two engines whose
model, dtype, block size, layer and head layout, and vLLM version all match."""

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Compatibility:
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    kv_layout: str
    vllm_version: str
    tensor_parallel_size: int

    @classmethod
    def from_message(cls, message) -> "Compatibility":
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)


def mismatches(producer: Compatibility, consumer: Compatibility) -> list[str]:
    """Each field that differs, as 'field: producer X != consumer Y'."""
    return [
        f"{f.name}: producer {getattr(producer, f.name)!r} != consumer "
        f"{getattr(consumer, f.name)!r}"
        for f in fields(Compatibility)
        if getattr(producer, f.name) != getattr(consumer, f.name)
    ]


def describe_refusal(producer: Compatibility, consumer: Compatibility) -> str:
    return "incompatible KV layout, refused: " + "; ".join(mismatches(producer, consumer))
