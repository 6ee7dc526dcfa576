"""The compatibility handshake: raw KV blocks only mean the same thing to two engines whose
model, KV-cache dtype (not the model's: an fp8 cache and a bf16 cache hold different bytes for
the same model), bytes per head-token, scale mode of a quantized cache, block size, layers, KV
heads, head size, wire layout and vLLM version all match, and whose integrity checks agree (a
receiver that checks nothing would load a checking sender's KV unverified; one that checks
would refuse every slice of a sender that digests none). A mismatch refuses the pair twice:
the router pairs only equal fingerprints (published in each worker's Health), and a receiver
refuses the hello (the transfer fails at once and the decode worker's policy applies).
Tensor parallelism need not match: each side re-shards the heads (kv_transfer/head_shards.py),
and the cache layouts need not either: KV travels in one wire order (kv_transfer/kv_layout.py).
"""

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from kv_transfer.kv_layout import WIRE_LAYOUT
from pdserve.settings.cluster_secret import secret_matches


@dataclass(frozen=True)
class Compatibility:
    model: str
    dtype: str  # the KV cache's: vLLM's cache_dtype, "auto" resolved to the model's dtype
    block_size: int
    num_layers: int
    total_kv_heads: int  # over all tensor-parallel ranks (1 for MLA: cache_heads)
    head_size: int
    kv_layout: str  # the wire order, kv_layout.WIRE_LAYOUT
    vllm_version: str
    bytes_per_head_token: int  # K and V (or one MLA latent) of one head for one token
    kv_scale_mode: str  # "none" for an unquantized cache (see kv_scale_mode below)
    integrity: bool = True  # slices carry digests and epochs (kv_transfer/integrity.py)

    @classmethod
    def from_message(cls, message) -> "Compatibility":
        return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """What workers publish in Health, so the router pairs only workers whose handshake
        would succeed: equal exactly when every field is (the hash), and readable, so that a
        refusal can say what each side has."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return (
            f"{self.model} KV {self.dtype} ({self.kv_scale_mode} scales, "
            f"{self.bytes_per_head_token} B per head-token), {self.total_kv_heads} KV heads x "
            f"{self.head_size}, block {self.block_size}, {self.num_layers} layers, vLLM "
            f"{self.vllm_version}, integrity {'on' if self.integrity else 'off'} #{digest}"
        )


def max_slice_bytes(compatibility: Compatibility, max_model_len: int) -> int:
    """The largest layer slice a sender can have for this engine: every head of one layer of
    its longest request (a receiver refuses a larger one before making its buffer)."""
    blocks = -(-max_model_len // compatibility.block_size)
    return (
        blocks
        * compatibility.block_size
        * compatibility.total_kv_heads
        * compatibility.bytes_per_head_token
    )


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> str:
    """vLLM's cache_dtype as the handshake names it: "auto" is the model's dtype, and "fp8" is
    fp8_e4m3 (vLLM: "fp8 (=fp8_e4m3)"), so two names for the same bytes compare equal."""
    if cache_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype


def kv_scale_mode(cache_dtype: str, kv_cache_scheme: dict | None, skip_layers: list) -> str:
    """How a quantized cache's bytes are scaled, which two workers must agree on to read each
    other's blocks: vLLM's KVQuantMode for the dtype ("none", "fp8_per_tensor",
    "fp8_per_token_head", ...), per-head checkpoint scales when the checkpoint's KV scheme
    says so, and the layers vLLM leaves unquantized (`kv_cache_dtype_skip_layers`)."""
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    quant_mode = get_kv_quant_mode(cache_dtype)
    mode = quant_mode.name.lower()
    if (
        quant_mode == KVQuantMode.FP8_PER_TENSOR
        and (kv_cache_scheme or {}).get("strategy") == "attn_head"
    ):
        mode = "fp8_per_head"
    if quant_mode != KVQuantMode.NONE and skip_layers:
        mode += " except layers " + ",".join(str(layer) for layer in skip_layers)
    return mode


def cache_heads(model_config) -> tuple[int, int]:
    """(KV heads over all tensor-parallel ranks, kv size: values per head-token in units of
    head size) of the cache vLLM keeps for a model: K and V per KV head (2), or for multi-head
    latent attention one latent per token (1), no V, as one head replicated on every rank
    (vLLM's `get_num_kv_heads` is 1 for MLA, but its `get_total_num_kv_heads` counts the
    attention's heads, which have no cache of their own)."""
    if model_config.use_mla:
        return 1, 1
    return model_config.get_total_num_kv_heads(), 2


def compatibility_of(vllm_config) -> Compatibility:
    """This engine's side of the handshake, read where vLLM 0.32 keeps it: the KV cache's dtype
    in `cache_config.cache_dtype` (already resolved from the checkpoint's KV scheme by
    EngineArgs), its element size from vLLM's own map (fp8 caches are uint8 storage, an fp8
    MLA latent too: 576 bytes a token for DeepSeek); the integrity setting from the
    connector's configuration (pdserve/worker/engine.py)."""
    import vllm
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    model, parallel, cache = (
        vllm_config.model_config,
        vllm_config.parallel_config,
        vllm_config.cache_config,
    )
    element = get_kv_cache_torch_dtype(cache.cache_dtype, model.dtype)
    head_size = model.get_head_size()
    total_kv_heads, kv_size = cache_heads(model)
    return Compatibility(
        model=Path(model.model).name,
        dtype=kv_cache_dtype(cache.cache_dtype, model.dtype),
        block_size=cache.block_size,
        num_layers=model.get_num_layers(parallel),
        total_kv_heads=total_kv_heads,
        head_size=head_size,
        kv_layout=WIRE_LAYOUT,
        vllm_version=vllm.__version__,
        bytes_per_head_token=kv_size * head_size * element.itemsize,
        kv_scale_mode=kv_scale_mode(
            cache.cache_dtype,
            getattr(vllm_config.quant_config, "kv_cache_scheme", None),
            cache.kv_cache_dtype_skip_layers,
        ),
        integrity=integrity_of(vllm_config),
    )


def integrity_of(vllm_config) -> bool:
    """Whether this engine's connector digests (a sender) or checks (a receiver) its KV: its
    own setting, or in vLLM's MultiConnector (a worker in a KV pool) its first connector's,
    pdserve's own (pdserve/worker/engine.py)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None:
        return True
    extra = transfer.kv_connector_extra_config or {}
    if transfer.kv_connector == "MultiConnector":
        extra = extra["connectors"][0].get("kv_connector_extra_config", {})
    return bool(extra.get("integrity", True))


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
