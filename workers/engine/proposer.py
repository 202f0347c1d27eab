"""The proposer protocol: what a drafter of speculative tokens offers the engine.

A proposer sees the decoding requests of a step (their token ids so far and sampling params) and
how many tokens the engine wants for each (``DraftAsk``), and answers with a ``Draft`` per request
it could draft for (fewer tokens than asked, or none, are fine: the request then decodes plainly).
Each draft token x_i comes with the distribution q_i it was drawn from, or none when drafting was
deterministic (q_i = one-hot(x_i)); workers/sample/rejection_sampler.py needs it for sampled
requests.

Implementations: ``NgramProposer`` (prompt lookup, in-process), ``DraftModelProposer`` (a small LM
on a drafter replica, reached over one gRPC stream per replica: the worker's private drafter actor,
or the replica of a drafter pool the router picked for the request, ``DraftAsk.drafter``).
Worked example::

    proposer = NgramProposer(ngram_min=1, ngram_max=4)
    drafts = proposer.propose([DraftAsk("r1", [1, 2, 3, 9, 1, 2], 3, params)])
    drafts["r1"].token_ids   # [3, 9, 1]: what followed the earlier "1 2"

Axes: K draft tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workers.sampling_params import SamplingParams


@dataclass(frozen=True)
class DrafterRef:
    """The drafter replica a request drafts on: the router's pick from the drafter pool its worker
    names (SubmitRequest.drafter), kept with the request across P/D hand-off and migration."""

    worker_id: str
    endpoint: str
    incarnation: str = ""


@dataclass(frozen=True)
class DraftAsk:
    """One request's turn: its tokens so far (prompt + output) and the most drafts wanted (>= 1);
    drafter: where it drafts (None: the proposer's own drafter, if it has one)."""

    request_id: str
    token_ids: list[int]
    num_tokens: int
    params: SamplingParams
    drafter: DrafterRef | None = None


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # K >= 1 draft tokens
    probs: torch.Tensor | None = None  # [K, V] the distributions they were drawn from; None = deterministic


@dataclass
class ProposerStats:
    """Counters since start (the engine adds its own acceptance counters)."""

    calls: int = 0
    seconds: float = 0.0  # wall time spent waiting for drafts
    fallbacks: int = 0  # requests that went without drafts because the drafter failed or timed out
    reattaches: int = 0  # times a lost drafter came back
    extra: dict[str, float] = field(default_factory=dict)


class Proposer(Protocol):
    name: str

    def propose(self, asks: list[DraftAsk]) -> dict[str, Draft]:
        """Drafts for (some of) the asks, keyed by request id. Never raises for a drafter failure:
        a failed request simply gets no draft (and counts in ``stats().fallbacks``)."""
        ...

    def prefetch(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 drafter: DrafterRef | None = None) -> None:
        """A request will decode soon with this context (disaggregated: its prompt KV is on the
        way; migrated: its KV is); a stateful drafter starts computing its own prompt KV now (or,
        holding the request already, keeps what it has)."""
        ...

    def release(self, request_id: str, *, handed_over: bool = False) -> None:
        """The request finished or was aborted: drop its drafting state. handed_over: it continues
        on another worker (live migration): forget it here, but leave a shared drafter's state to
        the worker that now holds it."""
        ...

    def stats(self) -> ProposerStats: ...

    def close(self) -> None: ...
