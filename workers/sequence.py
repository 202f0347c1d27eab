"""Sequence: the one request-state object the engine keeps per request.

Terms:
    token_ids           prompt followed by the output generated so far.
    num_computed_tokens tokens whose KV is in the cache. Prefill, chunked prefill, prefix-cache
                        hits, decode and recompute after preemption all just move this counter:
                        the scheduler asks for ``num_tokens - num_computed_tokens`` more.
Example: a 10-token prompt after one 4-token chunk has num_computed_tokens=4; after the second
chunk (6 tokens) it is 10 and the first output token is sampled (num_tokens=11); each decode step
then computes exactly one token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (recomputed on resume)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        """True once the prompt (and any recomputed output) is cached: one new token per step."""
        return self.num_tokens - self.num_computed_tokens == 1 and self.num_output_tokens > 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
