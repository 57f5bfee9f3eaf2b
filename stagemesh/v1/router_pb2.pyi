from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "priority", "request_id", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "stop_token_ids", "ignore_eos", "min_tokens", "cache_salt")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    priority: int
    request_id: str
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: bool
    top_logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    cache_salt: str
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "request_id", "cached_tokens", "logprobs", "usage", "seed")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    request_id: str
    cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    usage: Usage
    seed: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., request_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("index", "response", "error_code", "error_message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    response: GenerateResponse
    error_code: int
    error_message: str
    def __init__(self, index: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class ListChainsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageRef(_message.Message):
    __slots__ = ("address", "layer_start", "layer_end")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    address: str
    layer_start: int
    layer_end: int
    def __init__(self, address: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class Chain(_message.Message):
    __slots__ = ("chain_id", "stages", "healthy", "in_flight", "fingerprint", "kind", "tp_width", "length_class", "problem")
    CHAIN_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_CLASS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    chain_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StageRef]
    healthy: bool
    in_flight: int
    fingerprint: str
    kind: str
    tp_width: int
    length_class: str
    problem: str
    def __init__(self, chain_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageRef, _Mapping]]] = ..., healthy: _Optional[bool] = ..., in_flight: _Optional[int] = ..., fingerprint: _Optional[str] = ..., kind: _Optional[str] = ..., tp_width: _Optional[int] = ..., length_class: _Optional[str] = ..., problem: _Optional[str] = ...) -> None: ...

class ListChainsResponse(_message.Message):
    __slots__ = ("model", "chains", "plan")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    model: str
    chains: _containers.RepeatedCompositeFieldContainer[Chain]
    plan: str
    def __init__(self, model: _Optional[str] = ..., chains: _Optional[_Iterable[_Union[Chain, _Mapping]]] = ..., plan: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "context_length", "vocab_size", "fingerprint", "chat_template", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    context_length: int
    vocab_size: int
    fingerprint: str
    chat_template: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., fingerprint: _Optional[str] = ..., chat_template: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
