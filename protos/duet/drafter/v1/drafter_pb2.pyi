from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DraftItem(_message.Message):
    __slots__ = ("request_id", "keep", "new_token_ids", "num_tokens", "sampling", "full_context", "held_len", "vocab_limit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FULL_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HELD_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_LIMIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    keep: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    sampling: Sampling
    full_context: bool
    held_len: int
    vocab_limit: int
    def __init__(self, request_id: _Optional[str] = ..., keep: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., full_context: _Optional[bool] = ..., held_len: _Optional[int] = ..., vocab_limit: _Optional[int] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("round", "items", "release", "target")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    round: int
    items: _containers.RepeatedCompositeFieldContainer[DraftItem]
    release: _containers.RepeatedScalarFieldContainer[str]
    target: str
    def __init__(self, round: _Optional[int] = ..., items: _Optional[_Iterable[_Union[DraftItem, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ..., target: _Optional[str] = ...) -> None: ...

class Drafted(_message.Message):
    __slots__ = ("request_id", "token_ids", "probs", "vocab_size", "resync")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    vocab_size: int
    resync: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ..., vocab_size: _Optional[int] = ..., resync: _Optional[bool] = ...) -> None: ...

class RoundResponse(_message.Message):
    __slots__ = ("round", "drafts", "incarnation", "compute_seconds", "queue_seconds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    drafts: _containers.RepeatedCompositeFieldContainer[Drafted]
    incarnation: str
    compute_seconds: float
    queue_seconds: float
    def __init__(self, round: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[Drafted, _Mapping]]] = ..., incarnation: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ...) -> None: ...

class GetDrafterLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterLoad(_message.Message):
    __slots__ = ("worker_id", "incarnation", "model", "num_requests", "num_active", "num_streams", "kv_blocks_total", "kv_blocks_used", "kv_block_size", "rounds", "items", "draft_tokens", "forward_passes", "batched_rows", "compute_seconds", "evictions", "expired", "releases", "resyncs", "tokens_computed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_ROWS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    model: str
    num_requests: int
    num_active: int
    num_streams: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_block_size: int
    rounds: int
    items: int
    draft_tokens: int
    forward_passes: int
    batched_rows: int
    compute_seconds: float
    evictions: int
    expired: int
    releases: int
    resyncs: int
    tokens_computed: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., model: _Optional[str] = ..., num_requests: _Optional[int] = ..., num_active: _Optional[int] = ..., num_streams: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., rounds: _Optional[int] = ..., items: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., forward_passes: _Optional[int] = ..., batched_rows: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., evictions: _Optional[int] = ..., expired: _Optional[int] = ..., releases: _Optional[int] = ..., resyncs: _Optional[int] = ..., tokens_computed: _Optional[int] = ...) -> None: ...
