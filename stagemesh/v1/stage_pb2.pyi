from stagemesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "max_length", "request_id", "next_address", "next_key", "upstream_key", "sampling", "wire_dtype", "previous_address", "keep_output", "trace_context", "repairable", "prefix_ids", "prefix_salt", "token_history", "prompt_length")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEEP_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REPAIRABLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HISTORY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_length: int
    request_id: str
    next_address: str
    next_key: str
    upstream_key: str
    sampling: SamplingParams
    wire_dtype: str
    previous_address: str
    keep_output: bool
    trace_context: _containers.ScalarMap[str, str]
    repairable: bool
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_salt: str
    token_history: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    def __init__(self, session_id: _Optional[str] = ..., max_length: _Optional[int] = ..., request_id: _Optional[str] = ..., next_address: _Optional[str] = ..., next_key: _Optional[str] = ..., upstream_key: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., wire_dtype: _Optional[str] = ..., previous_address: _Optional[str] = ..., keep_output: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., repairable: _Optional[bool] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., prefix_salt: _Optional[str] = ..., token_history: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "cached_positions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cached_positions: int
    def __init__(self, session_id: _Optional[str] = ..., cached_positions: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "suppress_ids", "suppress_until", "logprobs", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_UNTIL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    suppress_ids: _containers.RepeatedScalarFieldContainer[int]
    suppress_until: int
    logprobs: bool
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., suppress_ids: _Optional[_Iterable[int]] = ..., suppress_until: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "start", "token_ids", "hidden", "sampling", "return_logits", "skip_sample", "wire_dtype", "hop_key", "ack")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOP_KEY_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    token_ids: _tensor_pb2.Tensor
    hidden: _tensor_pb2.Tensor
    sampling: SamplingParams
    return_logits: bool
    skip_sample: bool
    wire_dtype: str
    hop_key: str
    ack: bool
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logits: _Optional[bool] = ..., skip_sample: _Optional[bool] = ..., wire_dtype: _Optional[str] = ..., hop_key: _Optional[str] = ..., ack: _Optional[bool] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[ForwardRequest]
    def __init__(self, steps: _Optional[_Iterable[_Union[ForwardRequest, _Mapping]]] = ...) -> None: ...

class RelayStatus(_message.Message):
    __slots__ = ("session_id", "code", "details")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    code: int
    details: str
    def __init__(self, session_id: _Optional[str] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("session_id", "token_id", "logits", "logprob", "top_token_ids", "top_logprobs", "ack")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_id: int
    logits: _tensor_pb2.Tensor
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ack: bool
    def __init__(self, session_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., ack: _Optional[bool] = ...) -> None: ...

class ReadOutputRequest(_message.Message):
    __slots__ = ("session_id", "start", "end", "chunk_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    end: int
    chunk_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("start", "hidden")
    START_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    start: int
    hidden: _tensor_pb2.Tensor
    def __init__(self, start: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("opens", "steps", "close", "reroute")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    REROUTE_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[OpenSessionRequest]
    steps: _containers.RepeatedCompositeFieldContainer[ForwardRequest]
    close: _containers.RepeatedScalarFieldContainer[str]
    reroute: _containers.RepeatedCompositeFieldContainer[Reroute]
    def __init__(self, opens: _Optional[_Iterable[_Union[OpenSessionRequest, _Mapping]]] = ..., steps: _Optional[_Iterable[_Union[ForwardRequest, _Mapping]]] = ..., close: _Optional[_Iterable[str]] = ..., reroute: _Optional[_Iterable[_Union[Reroute, _Mapping]]] = ...) -> None: ...

class Reroute(_message.Message):
    __slots__ = ("session_id", "position", "next_address", "next_key", "wait")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    position: int
    next_address: str
    next_key: str
    wait: bool
    def __init__(self, session_id: _Optional[str] = ..., position: _Optional[int] = ..., next_address: _Optional[str] = ..., next_key: _Optional[str] = ..., wait: _Optional[bool] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("opened", "results", "faults", "rerouted", "cached_positions")
    class CachedPositionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    REROUTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    opened: _containers.RepeatedScalarFieldContainer[str]
    results: _containers.RepeatedCompositeFieldContainer[ForwardResponse]
    faults: _containers.RepeatedCompositeFieldContainer[RelayStatus]
    rerouted: _containers.RepeatedScalarFieldContainer[str]
    cached_positions: _containers.ScalarMap[str, int]
    def __init__(self, opened: _Optional[_Iterable[str]] = ..., results: _Optional[_Iterable[_Union[ForwardResponse, _Mapping]]] = ..., faults: _Optional[_Iterable[_Union[RelayStatus, _Mapping]]] = ..., rerouted: _Optional[_Iterable[str]] = ..., cached_positions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("model", "family", "layer_start", "layer_end", "num_layers", "is_first", "is_last", "dtype", "device", "hidden_size", "vocab_size", "max_position", "weight_bytes", "peak_rss_bytes", "open_sessions", "kv_used_bytes", "kv_capacity_bytes", "queued_steps", "step_ms", "pass_ms", "load_s", "max_batch_tokens", "fingerprint", "kv_block_size", "kv_blocks_used", "kv_blocks_total", "kv_preemptions", "decode_phase_seconds", "decode_steps", "tp_size", "output_log_bytes", "output_logs_dropped", "kv_prefix_blocks", "kv_prefix_hit_positions", "attention_kernel", "packed_weights", "cuda_graphs", "link_sessions", "relay_queued_bytes", "streams_waiting")
    class DecodePhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    PASS_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PREFIX_HIT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_KERNEL_FIELD_NUMBER: _ClassVar[int]
    PACKED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    LINK_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RELAY_QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_WAITING_FIELD_NUMBER: _ClassVar[int]
    model: str
    family: str
    layer_start: int
    layer_end: int
    num_layers: int
    is_first: bool
    is_last: bool
    dtype: str
    device: str
    hidden_size: int
    vocab_size: int
    max_position: int
    weight_bytes: int
    peak_rss_bytes: int
    open_sessions: int
    kv_used_bytes: int
    kv_capacity_bytes: int
    queued_steps: int
    step_ms: float
    pass_ms: float
    load_s: float
    max_batch_tokens: int
    fingerprint: str
    kv_block_size: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_preemptions: int
    decode_phase_seconds: _containers.ScalarMap[str, float]
    decode_steps: int
    tp_size: int
    output_log_bytes: int
    output_logs_dropped: int
    kv_prefix_blocks: int
    kv_prefix_hit_positions: int
    attention_kernel: str
    packed_weights: bool
    cuda_graphs: int
    link_sessions: int
    relay_queued_bytes: int
    streams_waiting: int
    def __init__(self, model: _Optional[str] = ..., family: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_position: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., open_sessions: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., queued_steps: _Optional[int] = ..., step_ms: _Optional[float] = ..., pass_ms: _Optional[float] = ..., load_s: _Optional[float] = ..., max_batch_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_preemptions: _Optional[int] = ..., decode_phase_seconds: _Optional[_Mapping[str, float]] = ..., decode_steps: _Optional[int] = ..., tp_size: _Optional[int] = ..., output_log_bytes: _Optional[int] = ..., output_logs_dropped: _Optional[int] = ..., kv_prefix_blocks: _Optional[int] = ..., kv_prefix_hit_positions: _Optional[int] = ..., attention_kernel: _Optional[str] = ..., packed_weights: _Optional[bool] = ..., cuda_graphs: _Optional[int] = ..., link_sessions: _Optional[int] = ..., relay_queued_bytes: _Optional[int] = ..., streams_waiting: _Optional[int] = ...) -> None: ...
