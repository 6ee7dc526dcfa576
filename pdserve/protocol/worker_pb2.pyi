from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens", "vllm_fields_json", "n", "logprobs", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VLLM_FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool
    min_tokens: int
    vllm_fields_json: str
    n: int
    logprobs: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., vllm_fields_json: _Optional[str] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class KvTransfer(_message.Message):
    __slots__ = ("transfer_id", "send_to", "receive_timeout_s", "kv_tokens", "peer_tensor_parallel_size", "transport", "skip_tokens", "peer_data_parallel_rank")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SEND_TO_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    send_to: str
    receive_timeout_s: float
    kv_tokens: int
    peer_tensor_parallel_size: int
    transport: str
    skip_tokens: int
    peer_data_parallel_rank: int
    def __init__(self, transfer_id: _Optional[str] = ..., send_to: _Optional[str] = ..., receive_timeout_s: _Optional[float] = ..., kv_tokens: _Optional[int] = ..., peer_tensor_parallel_size: _Optional[int] = ..., transport: _Optional[str] = ..., skip_tokens: _Optional[int] = ..., peer_data_parallel_rank: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv", "pool_fetch", "cache_salt", "data_parallel_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    POOL_FETCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv: KvTransfer
    pool_fetch: PoolFetch
    cache_salt: str
    data_parallel_rank: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KvTransfer, _Mapping]] = ..., pool_fetch: _Optional[_Union[PoolFetch, _Mapping]] = ..., cache_salt: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class PoolFetch(_message.Message):
    __slots__ = ("source", "tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: str
    tokens: int
    def __init__(self, source: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class PoolBlocksRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PoolBlockChunk(_message.Message):
    __slots__ = ("block", "offset", "data", "header")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    block: int
    offset: int
    data: bytes
    header: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., header: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestTiming(_message.Message):
    __slots__ = ("queued_seconds", "prefill_seconds", "decode_seconds")
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queued_seconds: float
    prefill_seconds: float
    decode_seconds: float
    def __init__(self, queued_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens", "timing", "kv", "index", "logprobs", "prompt_logprobs", "stop_string", "stop_token_id", "cumulative_logprob")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    timing: RequestTiming
    kv: KvTransferStats
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    stop_string: str
    stop_token_id: int
    cumulative_logprob: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., timing: _Optional[_Union[RequestTiming, _Mapping]] = ..., kv: _Optional[_Union[KvTransferStats, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "decoded_token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., decoded_token: _Optional[str] = ...) -> None: ...

class KvTransferStats(_message.Message):
    __slots__ = ("bytes", "seconds", "failed", "failure", "transport")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    failed: bool
    failure: str
    transport: str
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., failed: _Optional[bool] = ..., failure: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("starts", "credits", "aborts")
    STARTS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    starts: _containers.RepeatedCompositeFieldContainer[RequestStart]
    credits: _containers.RepeatedCompositeFieldContainer[Credit]
    aborts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, starts: _Optional[_Iterable[_Union[RequestStart, _Mapping]]] = ..., credits: _Optional[_Iterable[_Union[Credit, _Mapping]]] = ..., aborts: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("stream_id", "request", "trace_headers")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request: GenerateRequest
    trace_headers: _containers.ScalarMap[str, str]
    def __init__(self, stream_id: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., trace_headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("stream_id", "taken")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    taken: int
    def __init__(self, stream_id: _Optional[int] = ..., taken: _Optional[int] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("stream_id", "chunk", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: GenerateChunk
    end: RequestEnd
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., end: _Optional[_Union[RequestEnd, _Mapping]] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("was_running",)
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    def __init__(self, was_running: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("state", "message", "worker_id", "role", "model", "max_model_len", "kv_address", "kv_failure_policy", "tensor_parallel_size", "kv_transport", "host_id", "device", "max_num_seqs", "kv_compatibility", "kv_pool", "data_parallel_ranks")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STARTING: _ClassVar[HealthReply.State]
        READY: _ClassVar[HealthReply.State]
        DRAINING: _ClassVar[HealthReply.State]
        FAILED: _ClassVar[HealthReply.State]
    STARTING: HealthReply.State
    READY: HealthReply.State
    DRAINING: HealthReply.State
    FAILED: HealthReply.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANKS_FIELD_NUMBER: _ClassVar[int]
    state: HealthReply.State
    message: str
    worker_id: str
    role: str
    model: str
    max_model_len: int
    kv_address: str
    kv_failure_policy: str
    tensor_parallel_size: int
    kv_transport: str
    host_id: str
    device: str
    max_num_seqs: int
    kv_compatibility: str
    kv_pool: str
    data_parallel_ranks: int
    def __init__(self, state: _Optional[_Union[HealthReply.State, str]] = ..., message: _Optional[str] = ..., worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_address: _Optional[str] = ..., kv_failure_policy: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., kv_transport: _Optional[str] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., kv_compatibility: _Optional[str] = ..., kv_pool: _Optional[str] = ..., data_parallel_ranks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("fresh", "kv_pool_contents", "kv_pool_store_id", "kv_pool_since")
    FRESH_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_STORE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SINCE_FIELD_NUMBER: _ClassVar[int]
    fresh: bool
    kv_pool_contents: bool
    kv_pool_store_id: str
    kv_pool_since: int
    def __init__(self, fresh: _Optional[bool] = ..., kv_pool_contents: _Optional[bool] = ..., kv_pool_store_id: _Optional[str] = ..., kv_pool_since: _Optional[int] = ...) -> None: ...

class KvPoolContents(_message.Message):
    __slots__ = ("store_id", "since", "sequence", "reset", "added", "removed", "block_size", "none_hash")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NONE_HASH_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    since: int
    sequence: int
    reset: bool
    added: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    none_hash: bytes
    def __init__(self, store_id: _Optional[str] = ..., since: _Optional[int] = ..., sequence: _Optional[int] = ..., reset: _Optional[bool] = ..., added: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., none_hash: _Optional[bytes] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("worker_id", "running_requests", "waiting_requests", "kv_blocks_used", "kv_blocks_total", "outstanding_prefill_tokens", "prefill_seconds_per_token", "decode_step_base_seconds", "decode_step_seconds_per_sequence", "prefilling_requests", "kv_pool_contents", "kv_pool_load_seconds_per_token", "kv_pool_fetch_seconds_per_token", "data_parallel_running")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_BASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_SECONDS_PER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_CONTENTS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FETCH_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    running_requests: int
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    outstanding_prefill_tokens: int
    prefill_seconds_per_token: float
    decode_step_base_seconds: float
    decode_step_seconds_per_sequence: float
    prefilling_requests: int
    kv_pool_contents: KvPoolContents
    kv_pool_load_seconds_per_token: float
    kv_pool_fetch_seconds_per_token: float
    data_parallel_running: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., outstanding_prefill_tokens: _Optional[int] = ..., prefill_seconds_per_token: _Optional[float] = ..., decode_step_base_seconds: _Optional[float] = ..., decode_step_seconds_per_sequence: _Optional[float] = ..., prefilling_requests: _Optional[int] = ..., kv_pool_contents: _Optional[_Union[KvPoolContents, _Mapping]] = ..., kv_pool_load_seconds_per_token: _Optional[float] = ..., kv_pool_fetch_seconds_per_token: _Optional[float] = ..., data_parallel_running: _Optional[_Iterable[int]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds", "timeout_seconds")
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    timeout_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("drained", "requests_left", "seconds")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    requests_left: int
    seconds: float
    def __init__(self, drained: _Optional[bool] = ..., requests_left: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelTransferReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
