from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SharedAdapter(_message.Message):
    __slots__ = ("name", "source", "base_model", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    base_model: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., base_model: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SharedAdapters(_message.Message):
    __slots__ = ("revision", "adapters")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    adapters: _containers.RepeatedCompositeFieldContainer[SharedAdapter]
    def __init__(self, revision: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[SharedAdapter, _Mapping]]] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class WakeRequest(_message.Message):
    __slots__ = ("roles", "requester")
    ROLES_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    roles: _containers.RepeatedScalarFieldContainer[str]
    requester: str
    def __init__(self, roles: _Optional[_Iterable[str]] = ..., requester: _Optional[str] = ...) -> None: ...

class WakeReply(_message.Message):
    __slots__ = ("woken", "waking", "from_standby")
    WOKEN_FIELD_NUMBER: _ClassVar[int]
    WAKING_FIELD_NUMBER: _ClassVar[int]
    FROM_STANDBY_FIELD_NUMBER: _ClassVar[int]
    woken: _containers.RepeatedScalarFieldContainer[str]
    waking: _containers.RepeatedScalarFieldContainer[str]
    from_standby: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, woken: _Optional[_Iterable[str]] = ..., waking: _Optional[_Iterable[str]] = ..., from_standby: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("watcher",)
    WATCHER_FIELD_NUMBER: _ClassVar[int]
    watcher: str
    def __init__(self, watcher: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("worker_id", "endpoint", "role", "pool", "draining", "drafter_pool", "model")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    role: str
    pool: str
    draining: bool
    drafter_pool: str
    model: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., role: _Optional[str] = ..., pool: _Optional[str] = ..., draining: _Optional[bool] = ..., drafter_pool: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class MemberList(_message.Message):
    __slots__ = ("version", "members", "adapters")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    adapters: SharedAdapters
    def __init__(self, version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., adapters: _Optional[_Union[SharedAdapters, _Mapping]] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "source", "base_model", "preload", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    base_model: str
    preload: bool
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., base_model: _Optional[str] = ..., preload: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterReply(_message.Message):
    __slots__ = ("unloaded_from", "busy")
    UNLOADED_FROM_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    unloaded_from: _containers.RepeatedScalarFieldContainer[str]
    busy: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unloaded_from: _Optional[_Iterable[str]] = ..., busy: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterStatus(_message.Message):
    __slots__ = ("name", "base_model", "source", "pinned", "origin", "loaded_on")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    LOADED_ON_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    source: str
    pinned: bool
    origin: str
    loaded_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., source: _Optional[str] = ..., pinned: _Optional[bool] = ..., origin: _Optional[str] = ..., loaded_on: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterStatusList(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterStatus]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterStatus, _Mapping]]] = ...) -> None: ...

class GetRouterStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("policy", "in_flight", "queued", "max_in_flight", "max_queue", "requests", "admitted", "rejected", "cancelled", "worker_stream_failures", "counters", "workers", "membership_version")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    WORKER_STREAM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy: str
    in_flight: int
    queued: int
    max_in_flight: int
    max_queue: int
    requests: int
    admitted: int
    rejected: int
    cancelled: int
    worker_stream_failures: int
    counters: _containers.ScalarMap[str, int]
    workers: _containers.RepeatedCompositeFieldContainer[RouterWorker]
    membership_version: int
    def __init__(self, policy: _Optional[str] = ..., in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., max_queue: _Optional[int] = ..., requests: _Optional[int] = ..., admitted: _Optional[int] = ..., rejected: _Optional[int] = ..., cancelled: _Optional[int] = ..., worker_stream_failures: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., workers: _Optional[_Iterable[_Union[RouterWorker, _Mapping]]] = ..., membership_version: _Optional[int] = ...) -> None: ...

class RouterWorker(_message.Message):
    __slots__ = ("worker_id", "endpoint", "healthy", "in_flight", "load_tokens", "last_error", "model", "adapters", "pool")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    healthy: bool
    in_flight: int
    load_tokens: int
    last_error: str
    model: str
    adapters: _containers.RepeatedScalarFieldContainer[str]
    pool: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight: _Optional[int] = ..., load_tokens: _Optional[int] = ..., last_error: _Optional[str] = ..., model: _Optional[str] = ..., adapters: _Optional[_Iterable[str]] = ..., pool: _Optional[str] = ...) -> None: ...
