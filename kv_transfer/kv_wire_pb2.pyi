from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compatibility(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "total_kv_heads", "head_size", "kv_layout", "vllm_version", "cluster_secret", "bytes_per_head_token", "kv_scale_mode", "integrity")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SECRET_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_HEAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_MODE_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    total_kv_heads: int
    head_size: int
    kv_layout: str
    vllm_version: str
    cluster_secret: str
    bytes_per_head_token: int
    kv_scale_mode: str
    integrity: bool
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., kv_layout: _Optional[str] = ..., vllm_version: _Optional[str] = ..., cluster_secret: _Optional[str] = ..., bytes_per_head_token: _Optional[int] = ..., kv_scale_mode: _Optional[str] = ..., integrity: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("transfer_id", "layer", "first_block", "num_blocks", "offset", "slice_bytes", "data", "last", "first_head", "num_heads", "segment", "length", "epoch", "seq", "digest")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    first_block: int
    num_blocks: int
    offset: int
    slice_bytes: int
    data: bytes
    last: bool
    first_head: int
    num_heads: int
    segment: int
    length: int
    epoch: int
    seq: int
    digest: int
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., offset: _Optional[int] = ..., slice_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., first_head: _Optional[int] = ..., num_heads: _Optional[int] = ..., segment: _Optional[int] = ..., length: _Optional[int] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., digest: _Optional[int] = ...) -> None: ...

class NcclOpen(_message.Message):
    __slots__ = ("host", "port", "backend", "timeout_s")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    backend: str
    timeout_s: float
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ShmReply(_message.Message):
    __slots__ = ("handshake", "free_segment")
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    FREE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    handshake: PushKvReply
    free_segment: int
    def __init__(self, handshake: _Optional[_Union[PushKvReply, _Mapping]] = ..., free_segment: _Optional[int] = ...) -> None: ...

class KvMessage(_message.Message):
    __slots__ = ("hello", "chunk", "nccl_open", "bye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NCCL_OPEN_FIELD_NUMBER: _ClassVar[int]
    BYE_FIELD_NUMBER: _ClassVar[int]
    hello: Compatibility
    chunk: KvChunk
    nccl_open: NcclOpen
    bye: bool
    def __init__(self, hello: _Optional[_Union[Compatibility, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., nccl_open: _Optional[_Union[NcclOpen, _Mapping]] = ..., bye: _Optional[bool] = ...) -> None: ...

class PushKvReply(_message.Message):
    __slots__ = ("accepted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    error: str
    def __init__(self, accepted: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason", "cluster_secret", "failure")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SECRET_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    cluster_secret: str
    failure: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., cluster_secret: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...

class CancelTransferReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
