from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceRecord(_message.Message):
    __slots__ = ("service_id", "address", "model", "meta")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    address: str
    model: str
    meta: _containers.ScalarMap[str, str]
    def __init__(self, service_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., meta: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("record", "passing")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    PASSING_FIELD_NUMBER: _ClassVar[int]
    record: ServiceRecord
    passing: bool
    def __init__(self, record: _Optional[_Union[ServiceRecord, _Mapping]] = ..., passing: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("record", "ttl_s", "deregister_after_s")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DEREGISTER_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    record: ServiceRecord
    ttl_s: float
    deregister_after_s: float
    def __init__(self, record: _Optional[_Union[ServiceRecord, _Mapping]] = ..., ttl_s: _Optional[float] = ..., deregister_after_s: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("service_id",)
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    def __init__(self, service_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("service_id",)
    SERVICE_ID_FIELD_NUMBER: _ClassVar[int]
    service_id: str
    def __init__(self, service_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WatchServicesRequest(_message.Message):
    __slots__ = ("index", "timeout_s", "model")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    index: int
    timeout_s: float
    model: str
    def __init__(self, index: _Optional[int] = ..., timeout_s: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class ServicesResponse(_message.Message):
    __slots__ = ("index", "services")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    index: int
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    def __init__(self, index: _Optional[int] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ...) -> None: ...

class KvEntry(_message.Message):
    __slots__ = ("key", "value", "modify_index")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    MODIFY_INDEX_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    modify_index: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., modify_index: _Optional[int] = ...) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("index", "entry")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    index: int
    entry: KvEntry
    def __init__(self, index: _Optional[int] = ..., entry: _Optional[_Union[KvEntry, _Mapping]] = ...) -> None: ...

class KvPutRequest(_message.Message):
    __slots__ = ("key", "value", "cas_index", "fence")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CAS_INDEX_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    cas_index: int
    fence: Fence
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., cas_index: _Optional[int] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("lock_key", "holder_id")
    LOCK_KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    lock_key: str
    holder_id: str
    def __init__(self, lock_key: _Optional[str] = ..., holder_id: _Optional[str] = ...) -> None: ...

class KvPutResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class KvDeleteRequest(_message.Message):
    __slots__ = ("key", "fence")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FENCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    fence: Fence
    def __init__(self, key: _Optional[str] = ..., fence: _Optional[_Union[Fence, _Mapping]] = ...) -> None: ...

class KvDeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvListRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class KvListResponse(_message.Message):
    __slots__ = ("index", "entries")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    index: int
    entries: _containers.RepeatedCompositeFieldContainer[KvEntry]
    def __init__(self, index: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[KvEntry, _Mapping]]] = ...) -> None: ...

class WatchKeyRequest(_message.Message):
    __slots__ = ("key", "index", "timeout_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    index: int
    timeout_s: float
    def __init__(self, key: _Optional[str] = ..., index: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WatchPrefixRequest(_message.Message):
    __slots__ = ("prefix", "index", "timeout_s")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    index: int
    timeout_s: float
    def __init__(self, prefix: _Optional[str] = ..., index: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LockRequest(_message.Message):
    __slots__ = ("key", "holder_id", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    holder_id: str
    ttl_s: float
    def __init__(self, key: _Optional[str] = ..., holder_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class LockResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class LockHolderRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class LockHolderResponse(_message.Message):
    __slots__ = ("held", "holder_name")
    HELD_FIELD_NUMBER: _ClassVar[int]
    HOLDER_NAME_FIELD_NUMBER: _ClassVar[int]
    held: bool
    holder_name: str
    def __init__(self, held: _Optional[bool] = ..., holder_name: _Optional[str] = ...) -> None: ...
