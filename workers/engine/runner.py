"""The boundary between the engine and whatever executes the model: the ``Runner`` protocol and
the typed messages both sides import (no cycles: this module imports only leaf modules).

Terms:
    runner      executes the model for one ``SchedulerOutput`` and samples; owns the KV cache
                tensors and per-request sampling state (params, seeded generator). ``ModelRunner``
                (workers/engine/model_runner.py) does it in one process; ``GangRunner``
                (workers/engine/gang_runner.py) drives a gang of TP / EP / SP ranks and presents the
                gang as one runner: its ``read_blocks`` returns model-wide KV (every kv head,
                gathered from the ranks that hold them) and its ``write_blocks`` takes model-wide
                KV (each rank keeps its heads). The engine never looks behind the protocol.
    KV layout   the cache geometry a runner holds (``KVLayout``): layers, block size, head dim,
                dtype, the model's kv heads and the range of them this runner holds. A single
                process and a gang hold every head; one TP rank's ModelRunner holds a slice.
    KV export   a prefilled request's hand-over (``KVExport``): first token, generator state and
                the KV of the blocks the decode side lacks.
    KV ticket   a decode-side reservation (``KVTicket``): which blocks wait for the transfer.

Worked example (what ``Engine.step`` does with its runner)::

    runner.add_request("r1", SamplingParams(temperature=0, max_tokens=8), prompt_ids, len(prompt_ids))
    out = runner.execute(scheduler_output)          # RunnerOutput({"r1": [token]})
    kv = runner.read_blocks([3, 4])                 # [L, 2, 2, bs, G, D], G = layout.num_kv_heads
    other_runner.write_blocks([7, 9], kv)           # same model, any parallel shape
    runner.remove_request("r1")

Axes: L layers, n blocks, bs block size, G kv heads (model-wide), D head dim.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from workers.errors import InvalidRequestError
from workers.sample.logprobs import TokenLogprob
from workers.models.config import ModelSpec
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import SchedulerOutput
from workers.engine.sequence import FinishReason
from workers.engine.proposer import Draft
from workers.structured.matcher import GrammarMatcher

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclass(frozen=True)
class KVLayout:
    """The KV cache geometry one runner holds. ``num_kv_heads`` is the model's total; this runner
    holds heads [kv_head_start, kv_head_start + num_local_kv_heads) (all of them unless it is one
    rank of a tensor-parallel gang). Transfers between workers always carry every head, so two
    workers agree when their ``wire_words`` agree, whatever their parallel shapes.

    Example (SmolLM2, 3 kv heads, TP=2): rank 0 holds KVLayout(30, 16, 3, 64, fp32, 0, 2), rank 1
    KVLayout(30, 16, 3, 64, fp32, 2, 1); the gang as a whole (GangRunner) KVLayout(30, 16, 3, 64, fp32)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_head_start: int = 0
    num_local_kv_heads: int | None = None  # None: every head

    def __post_init__(self) -> None:
        local = self.local_heads
        assert 0 <= self.kv_head_start and local >= 1 and self.kv_head_start + local <= self.num_kv_heads, self

    @property
    def local_heads(self) -> int:
        return self.num_kv_heads if self.num_local_kv_heads is None else self.num_local_kv_heads

    @property
    def holds_all_heads(self) -> bool:
        return self.kv_head_start == 0 and self.local_heads == self.num_kv_heads

    def whole(self) -> KVLayout:
        """The same geometry with every kv head (what a gang presents, and what travels)."""
        return KVLayout(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def as_words(self) -> list[int]:
        """The model-wide geometry as ints (the transfer header): layers, block size, kv heads, head dim, dtype."""
        return [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, DTYPE_CODES[self.dtype]]


def kv_fingerprint(spec: Any, dtype: torch.dtype | str, quantization: str = "none") -> int:
    """A signed 64-bit id of (architecture spec, cache dtype, weight format): two workers agree on it
    exactly when one's KV is valid in the other's cache (workers/kv/wire.py carries and checks it).
    ``spec`` is a dataclass (``ModelSpec``); dtype a torch dtype or its name."""
    fields = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) and not isinstance(spec, type) else dict(spec)
    text = json.dumps({"spec": fields, "dtype": str(dtype).removeprefix("torch."), "quantization": quantization},
                      sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class RunnerTiming:
    """Wall-clock seconds (time.perf_counter) of one ``execute``'s parts; what is not the model
    itself (prepare, sample) is the step's overhead outside the kernels.

    prepare_s   the scheduler's lists -> input tensors and attention metadata
    forward_s   the model's forward pass over the step's tokens (KV written)
    logits_s    the LM head over the sampled rows
    sample_s    grammar masks, penalties, sampling, logprobs, verification of drafts
    """

    prepare_s: float = 0.0
    forward_s: float = 0.0
    logits_s: float = 0.0
    sample_s: float = 0.0


@dataclass(frozen=True)
class RunnerOutput:
    # request id -> tokens to append, for chunks with sample=True: one sampled token, or with drafts
    # the accepted drafts followed by the target's own token (1..num_draft + 1)
    sampled: dict[str, list[int]]
    # request id -> one TokenLogprob per token of ``sampled``, for requests that asked for logprobs
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> why it could not be sampled (structured output: its grammar admits no token);
    # such a request is in neither dict above, and the engine ends it with this error
    errors: Mapping[str, InvalidRequestError] = field(default_factory=dict)
    # where the step's time went (None from runners that do not measure it)
    timing: RunnerTiming | None = None


@dataclass(frozen=True)
class MoEStats:
    """Routed token assignments since start, summed over layers (empty for dense models)."""

    expert_tokens: tuple[int, ...] = ()  # per expert
    ep_rank_tokens: tuple[int, ...] = ()  # per expert-parallel rank that computed them


@dataclass(frozen=True)
class KVExport:
    """A prefilled request's hand-over: the first token, the sampling generator's state after it
    (None without a seed), the model-wide K/V of prompt blocks first_block.. ([L, 2, n, bs, G, D])
    and the first token's logprobs (None unless the request asked for them)."""

    first_token: int
    first_block: int
    kv: torch.Tensor
    generator_state: bytes | None
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class KVTicket:
    """A decode-side reservation: the first ``first_block`` blocks of the prompt were prefix-cache
    hits; blocks first_block..first_block+num_blocks-1 are allocated and wait for the transfer."""

    transfer_id: str
    first_block: int
    num_blocks: int
    num_cached_tokens: int


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a diff: only the new tokens and text)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_export: KVExport | None = None  # prefill side of a disaggregated request, on its final output
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    # set when the request failed mid-way (finished, finish_reason ABORT): structured output whose
    # spec did not compile or whose grammar admits no token; the message names the field
    error: InvalidRequestError | None = None


@runtime_checkable
class Runner(Protocol):
    """Everything the engine (and the KV hand-off) calls on whatever executes the model."""

    spec: ModelSpec
    block_size: int
    num_blocks: int  # KV blocks this runner's cache holds (every rank of a gang holds the same count)
    @property
    def model(self) -> Any:  # the nn.Module (rank 0's, for a gang): for inspection and tests, not for the engine
        ...

    def add_request(self, request_id: str, params: SamplingParams, token_ids: list[int], num_prompt: int,
                    output_start: int | None = None, matcher: GrammarMatcher | None = None) -> None:
        """Start tracking a request's sampling state: its params, seeded generator (if any), the
        engine's live token list (read only; the first num_prompt are the prompt, tokens from
        output_start on count as generated for the penalties and the grammar) and, for structured
        output, its grammar matcher (workers/structured/matcher.py; compiled before the request
        is first scheduled)."""

    def remove_request(self, request_id: str) -> None:
        """Forget a request's sampling state (idempotent)."""

    def execute(self, sched: SchedulerOutput, drafts: Mapping[str, Draft] | None = None) -> RunnerOutput:
        """Run one step's forward pass, write its KV, sample (and verify drafts)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K/V: [L, 2, n, bs, G, D], G the heads ``kv_layout`` says this runner
        holds (every head for a single process or a gang: what an engine's runner holds)."""

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite the blocks with kv [L, 2, n, bs, G, D], shaped as ``read_blocks`` returns."""

    def generator_state(self, request_id: str) -> bytes | None:
        """The request's sampling generator state (None without a seed), for hand-over."""

    def set_generator_state(self, request_id: str, state: bytes) -> None:
        """Restore a request's generator to a state from ``generator_state`` (a seeded request)."""

    def kv_layout(self) -> KVLayout:
        """The cache geometry this runner holds (``holds_all_heads`` for a whole model)."""

    def moe_stats(self) -> MoEStats:
        """Expert routing counters (empty for dense models)."""
