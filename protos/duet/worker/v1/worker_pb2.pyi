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
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class AdapterRef(_message.Message):
    __slots__ = ("name", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter", "pin")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterRef
    pin: bool
    def __init__(self, adapter: _Optional[_Union[AdapterRef, _Mapping]] = ..., pin: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "source", "rank", "target_modules", "pinned", "in_use", "load_seconds", "bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    IN_USE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    pinned: bool
    in_use: int
    load_seconds: float
    bytes: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., pinned: _Optional[bool] = ..., in_use: _Optional[int] = ..., load_seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class AdapterList(_message.Message):
    __slots__ = ("adapters", "max_loaded")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loaded: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loaded: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "remote_prefill", "resumed_output_tokens", "migration_id", "prefix_source", "drafter", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    remote_prefill: RemotePrefill
    resumed_output_tokens: int
    migration_id: str
    prefix_source: PrefixSource
    drafter: DrafterRef
    adapter: AdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ..., resumed_output_tokens: _Optional[int] = ..., migration_id: _Optional[str] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ..., drafter: _Optional[_Union[DrafterRef, _Mapping]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class DrafterRef(_message.Message):
    __slots__ = ("worker_id", "endpoint", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("worker_id", "endpoint", "incarnation", "num_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    incarnation: str
    num_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., incarnation: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("worker_id", "endpoint", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "num_speculative_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "top_logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    num_speculative_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "choice", "grammar")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "logprobs", "migrated_to")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_TO_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    migrated_to: MigratedTo
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., migrated_to: _Optional[_Union[MigratedTo, _Mapping]] = ...) -> None: ...

class SubmitStreamRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: SubmitOpen
    cancel: SubmitCancel
    def __init__(self, open: _Optional[_Union[SubmitOpen, _Mapping]] = ..., cancel: _Optional[_Union[SubmitCancel, _Mapping]] = ...) -> None: ...

class SubmitOpen(_message.Message):
    __slots__ = ("stream_id", "request", "timeout_s")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request: SubmitRequest
    timeout_s: float
    def __init__(self, stream_id: _Optional[int] = ..., request: _Optional[_Union[SubmitRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class SubmitCancel(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    def __init__(self, stream_id: _Optional[int] = ...) -> None: ...

class SubmitStreamResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[SubmitFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[SubmitFrame, _Mapping]]] = ...) -> None: ...

class SubmitFrame(_message.Message):
    __slots__ = ("stream_id", "response", "end")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: SubmitResponse
    end: SubmitEnd
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[SubmitResponse, _Mapping]] = ..., end: _Optional[_Union[SubmitEnd, _Mapping]] = ...) -> None: ...

class SubmitEnd(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class MigratedTo(_message.Message):
    __slots__ = ("worker_id", "endpoint", "incarnation", "migration_id", "num_output_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    incarnation: str
    migration_id: str
    num_output_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., incarnation: _Optional[str] = ..., migration_id: _Optional[str] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class MigrationTarget(_message.Message):
    __slots__ = ("worker_id", "endpoint", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    endpoint: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: MigrationTarget
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[_Union[MigrationTarget, _Mapping]] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("migration_id", "blocks_sent", "kv_bytes", "seconds")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    blocks_sent: int
    kv_bytes: int
    seconds: float
    def __init__(self, migration_id: _Optional[str] = ..., blocks_sent: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class MigrationState(_message.Message):
    __slots__ = ("prompt_token_ids", "output_token_ids", "sampling", "num_computed_tokens", "num_resumed_tokens", "num_cached_tokens", "generator_state", "detok_ids", "detok_prefix_offset", "detok_read_offset", "detok_text", "detok_emitted", "spec_acceptance", "spec_steps_at_zero", "drafter", "adapter")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    DETOK_IDS_FIELD_NUMBER: _ClassVar[int]
    DETOK_PREFIX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DETOK_READ_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DETOK_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETOK_EMITTED_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEPS_AT_ZERO_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_computed_tokens: int
    num_resumed_tokens: int
    num_cached_tokens: int
    generator_state: bytes
    detok_ids: _containers.RepeatedScalarFieldContainer[int]
    detok_prefix_offset: int
    detok_read_offset: int
    detok_text: str
    detok_emitted: int
    spec_acceptance: float
    spec_steps_at_zero: int
    drafter: DrafterRef
    adapter: AdapterRef
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_resumed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., generator_state: _Optional[bytes] = ..., detok_ids: _Optional[_Iterable[int]] = ..., detok_prefix_offset: _Optional[int] = ..., detok_read_offset: _Optional[int] = ..., detok_text: _Optional[str] = ..., detok_emitted: _Optional[int] = ..., spec_acceptance: _Optional[float] = ..., spec_steps_at_zero: _Optional[int] = ..., drafter: _Optional[_Union[DrafterRef, _Mapping]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class TakeOverRequest(_message.Message):
    __slots__ = ("request_id", "state", "source_worker_id", "source_incarnation", "model_fingerprint", "kv_layout", "expected_incarnation", "source_endpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: MigrationState
    source_worker_id: str
    source_incarnation: str
    model_fingerprint: str
    kv_layout: _containers.RepeatedScalarFieldContainer[int]
    expected_incarnation: str
    source_endpoint: str
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[MigrationState, _Mapping]] = ..., source_worker_id: _Optional[str] = ..., source_incarnation: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_layout: _Optional[_Iterable[int]] = ..., expected_incarnation: _Optional[str] = ..., source_endpoint: _Optional[str] = ...) -> None: ...

class TakeOverResponse(_message.Message):
    __slots__ = ("transfer_id", "first_block", "num_blocks", "kv_store_address", "pair_generation", "target_incarnation", "backend", "resumed", "kv_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_block: int
    num_blocks: int
    kv_store_address: str
    pair_generation: int
    target_incarnation: str
    backend: str
    resumed: bool
    kv_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_store_address: _Optional[str] = ..., pair_generation: _Optional[int] = ..., target_incarnation: _Optional[str] = ..., backend: _Optional[str] = ..., resumed: _Optional[bool] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("targets", "timeout_s")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[MigrationTarget]
    timeout_s: float
    def __init__(self, targets: _Optional[_Iterable[_Union[MigrationTarget, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("migrated", "failed", "remaining", "seconds")
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    migrated: int
    failed: int
    remaining: int
    seconds: float
    def __init__(self, migrated: _Optional[int] = ..., failed: _Optional[int] = ..., remaining: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "transfer_id", "first_block", "num_blocks", "kv_store_address", "decode_worker_id", "decode_incarnation", "pair_generation", "expected_incarnation", "backend", "resumed_output_tokens", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    transfer_id: str
    first_block: int
    num_blocks: int
    kv_store_address: str
    decode_worker_id: str
    decode_incarnation: str
    pair_generation: int
    expected_incarnation: str
    backend: str
    resumed_output_tokens: int
    adapter: AdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., transfer_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_store_address: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_incarnation: _Optional[str] = ..., pair_generation: _Optional[int] = ..., expected_incarnation: _Optional[str] = ..., backend: _Optional[str] = ..., resumed_output_tokens: _Optional[int] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "generator_state", "cached_prompt_tokens", "transfer_done", "kv_bytes", "transfer_seconds", "first_token_logprob")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    generator_state: bytes
    cached_prompt_tokens: int
    transfer_done: bool
    kv_bytes: int
    transfer_seconds: float
    first_token_logprob: TokenLogprob
    def __init__(self, first_token_id: _Optional[int] = ..., generator_state: _Optional[bytes] = ..., cached_prompt_tokens: _Optional[int] = ..., transfer_done: _Optional[bool] = ..., kv_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., first_token_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ...) -> None: ...

class PullPrefixRequest(_message.Message):
    __slots__ = ("transfer_id", "prefix_token_ids", "first_block", "kv_store_address", "receiver_worker_id", "receiver_incarnation", "pair_generation", "expected_incarnation", "backend", "adapter")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    kv_store_address: str
    receiver_worker_id: str
    receiver_incarnation: str
    pair_generation: int
    expected_incarnation: str
    backend: str
    adapter: AdapterRef
    def __init__(self, transfer_id: _Optional[str] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., kv_store_address: _Optional[str] = ..., receiver_worker_id: _Optional[str] = ..., receiver_incarnation: _Optional[str] = ..., pair_generation: _Optional[int] = ..., expected_incarnation: _Optional[str] = ..., backend: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class PullPrefixResponse(_message.Message):
    __slots__ = ("num_blocks", "kv_bytes", "transfer_seconds")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    kv_bytes: int
    transfer_seconds: float
    def __init__(self, num_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("block_events", "block_events_since", "block_events_incarnation")
    BLOCK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENTS_SINCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENTS_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    block_events: bool
    block_events_since: int
    block_events_incarnation: str
    def __init__(self, block_events: _Optional[bool] = ..., block_events_since: _Optional[int] = ..., block_events_incarnation: _Optional[str] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("incarnation", "kv_block_size", "block_seq", "block_snapshot", "blocks_stored", "blocks_removed", "blocks_stored_tiers")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_TIERS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    kv_block_size: int
    block_seq: int
    block_snapshot: bool
    blocks_stored: _containers.RepeatedScalarFieldContainer[int]
    blocks_removed: _containers.RepeatedScalarFieldContainer[int]
    blocks_stored_tiers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, incarnation: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., block_seq: _Optional[int] = ..., block_snapshot: _Optional[bool] = ..., blocks_stored: _Optional[_Iterable[int]] = ..., blocks_removed: _Optional[_Iterable[int]] = ..., blocks_stored_tiers: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "incarnation", "num_running", "num_waiting", "outstanding_tokens", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "kv_transfers_sent", "kv_bytes_sent", "kv_transfers_received", "kv_bytes_received", "kv_transfer_failures", "kv_transfer_seconds", "num_reserved", "expert_tokens", "ep_rank_tokens", "spec_method", "spec_verifies", "spec_draft_tokens", "spec_accepted_tokens", "spec_emitted_tokens", "spec_draft_seconds", "spec_verify_seconds", "spec_fallbacks", "migrations_out", "migrations_in", "migration_failures", "migration_kv_bytes", "migration_seconds", "block_events_supported", "block_seq", "block_snapshot", "blocks_stored", "blocks_removed", "blocks_stored_tiers", "draining", "prefix_pulls", "prefix_pull_blocks", "prefix_pull_bytes", "prefix_pull_failures", "prefix_pulls_served", "prefix_pull_tier_blocks_served", "tier_host_bytes", "tier_disk_bytes", "tier_host_hits", "tier_disk_hits", "tier_bytes_to_host", "tier_bytes_to_disk", "tier_bytes_loaded", "tier_host_evictions", "tier_disk_evictions", "tier_refused_corrupt", "tier_refused_foreign", "tier_deadline_misses", "tier_load_seconds", "adapters", "max_loaded_adapters", "submit_stream")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_METHOD_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFIES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_EVENTS_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULLS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_TIER_BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_TO_HOST_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_TO_DISK_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TIER_REFUSED_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    TIER_REFUSED_FOREIGN_FIELD_NUMBER: _ClassVar[int]
    TIER_DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TIER_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOADED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_STREAM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    num_running: int
    num_waiting: int
    outstanding_tokens: int
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    kv_transfers_sent: int
    kv_bytes_sent: int
    kv_transfers_received: int
    kv_bytes_received: int
    kv_transfer_failures: int
    kv_transfer_seconds: float
    num_reserved: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    ep_rank_tokens: _containers.RepeatedScalarFieldContainer[int]
    spec_method: str
    spec_verifies: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_emitted_tokens: int
    spec_draft_seconds: float
    spec_verify_seconds: float
    spec_fallbacks: int
    migrations_out: int
    migrations_in: int
    migration_failures: int
    migration_kv_bytes: int
    migration_seconds: float
    block_events_supported: bool
    block_seq: int
    block_snapshot: bool
    blocks_stored: _containers.RepeatedScalarFieldContainer[int]
    blocks_removed: _containers.RepeatedScalarFieldContainer[int]
    blocks_stored_tiers: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    prefix_pulls: int
    prefix_pull_blocks: int
    prefix_pull_bytes: int
    prefix_pull_failures: int
    prefix_pulls_served: int
    prefix_pull_tier_blocks_served: int
    tier_host_bytes: int
    tier_disk_bytes: int
    tier_host_hits: int
    tier_disk_hits: int
    tier_bytes_to_host: int
    tier_bytes_to_disk: int
    tier_bytes_loaded: int
    tier_host_evictions: int
    tier_disk_evictions: int
    tier_refused_corrupt: int
    tier_refused_foreign: int
    tier_deadline_misses: int
    tier_load_seconds: float
    adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loaded_adapters: int
    submit_stream: bool
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_transfers_sent: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_transfers_received: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_transfer_failures: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., num_reserved: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., ep_rank_tokens: _Optional[_Iterable[int]] = ..., spec_method: _Optional[str] = ..., spec_verifies: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_emitted_tokens: _Optional[int] = ..., spec_draft_seconds: _Optional[float] = ..., spec_verify_seconds: _Optional[float] = ..., spec_fallbacks: _Optional[int] = ..., migrations_out: _Optional[int] = ..., migrations_in: _Optional[int] = ..., migration_failures: _Optional[int] = ..., migration_kv_bytes: _Optional[int] = ..., migration_seconds: _Optional[float] = ..., block_events_supported: _Optional[bool] = ..., block_seq: _Optional[int] = ..., block_snapshot: _Optional[bool] = ..., blocks_stored: _Optional[_Iterable[int]] = ..., blocks_removed: _Optional[_Iterable[int]] = ..., blocks_stored_tiers: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ..., prefix_pulls: _Optional[int] = ..., prefix_pull_blocks: _Optional[int] = ..., prefix_pull_bytes: _Optional[int] = ..., prefix_pull_failures: _Optional[int] = ..., prefix_pulls_served: _Optional[int] = ..., prefix_pull_tier_blocks_served: _Optional[int] = ..., tier_host_bytes: _Optional[int] = ..., tier_disk_bytes: _Optional[int] = ..., tier_host_hits: _Optional[int] = ..., tier_disk_hits: _Optional[int] = ..., tier_bytes_to_host: _Optional[int] = ..., tier_bytes_to_disk: _Optional[int] = ..., tier_bytes_loaded: _Optional[int] = ..., tier_host_evictions: _Optional[int] = ..., tier_disk_evictions: _Optional[int] = ..., tier_refused_corrupt: _Optional[int] = ..., tier_refused_foreign: _Optional[int] = ..., tier_deadline_misses: _Optional[int] = ..., tier_load_seconds: _Optional[float] = ..., adapters: _Optional[_Iterable[str]] = ..., max_loaded_adapters: _Optional[int] = ..., submit_stream: _Optional[bool] = ...) -> None: ...
