"""Speculator: the engine's side of speculative decoding, between the scheduler and the proposer.

Each step, before scheduling, ``draft`` asks the adaptive policy how many tokens each decoding
request should draft (capped by its per-request setting, its remaining max_tokens and the context
limit), gets drafts from the proposer, and hands them to the scheduler. After the runner has
verified them, ``record`` feeds the outcome back (acceptance per request, the step's time vs the
drafts it carried) and counts the metrics the worker reports.

Where a request drafts: ``assign`` records the drafter replica the router picked for it (a drafter
pool's, SubmitRequest.drafter); its asks carry it to the proposer, which keeps one stream per
replica. A request with none drafts on the proposer's own drafter, if any.

Terms: a *verify* is one request's chunk with drafts in a step; *accepted* counts drafts kept;
*emitted* counts tokens appended by verifies (accepted + the target's own token).
acceptance_rate = accepted / drafted; mean_accepted_length = emitted / verifies (tokens per target
pass for speculating requests; 1.0 would be plain decoding).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workers.config import SpeculativeConfig
from workers.engine.scheduler import SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.draft_length import DraftLengthPolicy
from workers.engine.proposer import Draft, DraftAsk, DrafterRef, Proposer


@dataclass(frozen=True)
class SpecStats:
    method: str = "none"
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    draft_seconds: float = 0.0  # waiting for drafts
    verify_seconds: float = 0.0  # target steps that verified drafts
    num_fallbacks: int = 0  # requests that went without drafts because the drafter failed
    num_reattaches: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted_tokens / self.num_verifies if self.num_verifies else 0.0


class Speculator:
    def __init__(self, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.proposer = proposer
        self.config = config
        # a drafter model's round with the overlap drafts one token more than asked (its guess of the
        # target's token): one more pass over its rows
        extra = int(config.method == "draft_model" and config.overlap)
        self.policy = DraftLengthPolicy(config.num_speculative_tokens, config.adaptive, extra_passes=extra)
        self._verifies = self._drafted = self._accepted = self._emitted = 0
        self._draft_s = self._verify_s = 0.0
        # tokens each request had at its last draft call: a call that must first catch the drafter up
        # on more than one round's worth (its first, which computes the prompt, or one after a pause)
        # says nothing about the cost of a draft token
        self._drafted_at: dict[str, int] = {}
        self._drafters: dict[str, DrafterRef] = {}  # request id -> its drafter replica (drafter pools)

    def assign(self, request_id: str, drafter: DrafterRef | None) -> None:
        """The request drafts on ``drafter`` (None: the proposer's own). Called before the request
        is added, reserved or adopted, so its prefetch already goes there."""
        if drafter is None:
            self._drafters.pop(request_id, None)
        else:
            self._drafters[request_id] = drafter

    def drafter_of(self, request_id: str) -> DrafterRef | None:
        """The request's drafter replica (live migration carries it to the target worker)."""
        return self._drafters.get(request_id)

    def draft(self, running: Iterable[Sequence], max_model_len: int) -> dict[str, Draft]:
        """Drafts for the running requests that are decoding and want speculation this step."""
        decoding = [seq for seq in running if seq.in_decode]
        limits = []
        for seq in decoding:
            p = seq.sampling_params
            wanted = self.config.num_speculative_tokens
            if p.num_speculative_tokens is not None:
                wanted = min(wanted, p.num_speculative_tokens)
            # the drafts and the target's own token must fit max_tokens and the context limit
            limits.append((seq.request_id, min(wanted, p.max_tokens - seq.num_output_tokens - 1,
                                               max_model_len - seq.num_tokens), p.seed is not None))
        ks = self.policy.choose_step(limits)  # the step's rows are planned together
        asks = [DraftAsk(seq.request_id, seq.token_ids, k, seq.sampling_params, self._drafters.get(seq.request_id))
                for seq, k in zip(decoding, ks) if k > 0]
        if not asks:
            return {}
        t0 = time.perf_counter()
        drafts = self.proposer.propose(asks)
        dt = time.perf_counter() - t0
        self._draft_s += dt
        # Fit the draft cost on steady-state calls only: a request's first call also computes its
        # prompt on the drafter, and one after steps without drafts (k = 0 until a probe) catches the
        # drafter up on every token since: one-offs that say nothing about the cost of a draft token.
        round_tokens = self.config.num_speculative_tokens + 2  # the accepted drafts, the target's token, the guess
        steady = all(a.request_id in self._drafted_at and len(a.token_ids) - self._drafted_at[a.request_id]
                     <= round_tokens for a in asks)
        self._drafted_at.update((a.request_id, len(a.token_ids)) for a in asks)
        if drafts and steady:  # the call's passes (its longest window) over its requests' rows
            self.policy.observe_draft(max(a.num_tokens for a in asks), dt, len(asks))
        return drafts

    def record(self, sched: SchedulerOutput, sampled: Mapping[str, list[int]], seconds: float) -> None:
        """The step ran: per verified chunk, how many drafts were kept; and the step's cost."""
        drafted = verifies = 0
        for c in sched.chunks:
            if not c.num_draft or c.request_id not in sampled:  # (not sampled: failed, see RunnerOutput.errors)
                continue
            emitted = len(sampled[c.request_id])
            self.policy.observe(c.request_id, c.num_draft, emitted - 1)
            verifies += 1
            drafted += c.num_draft
            self._accepted += emitted - 1
            self._emitted += emitted
        self._verifies += verifies
        self._drafted += drafted
        if verifies:
            self._verify_s += seconds
        if all(len(c.token_ids) == 1 + c.num_draft and c.sample for c in sched.chunks):  # decode-only step
            self.policy.observe_step(sched.num_tokens, seconds)

    def prefetch(self, seq: Sequence, new: bool = False) -> None:
        """The request will decode here soon: a drafter model computes (or keeps) its context's KV now,
        while the target's KV is in transit (P/D, migration) or, for a ``new`` request added here,
        while the target prefills it; otherwise the request's first draft round would compute its
        prompt on the drafter while the target's whole batch waits for it. A request that asks for no
        speculation (num_speculative_tokens 0) costs the drafter nothing."""
        if new and seq.sampling_params.num_speculative_tokens == 0:
            return
        self.proposer.prefetch(seq.request_id, seq.token_ids, seq.sampling_params, self._drafters.get(seq.request_id))

    def request_state(self, request_id: str) -> tuple[float, int]:
        """One request's draft-length state (workers/engine/migration.py carries it to another worker, so a
        seeded request drafts, and so draws, exactly as it would have here)."""
        return self.policy.request_state(request_id)

    def set_request_state(self, request_id: str, state: tuple[float, int]) -> None:
        self.policy.set_request_state(request_id, state)

    def release(self, request_id: str, *, handed_over: bool = False) -> None:
        """The request ended here; handed_over: it continues on another worker (Proposer.release)."""
        self._drafted_at.pop(request_id, None)
        self._drafters.pop(request_id, None)
        self.policy.release(request_id)
        self.proposer.release(request_id, handed_over=handed_over)

    def stats(self) -> SpecStats:
        ps = self.proposer.stats()
        return SpecStats(self.config.method, self._verifies, self._drafted, self._accepted, self._emitted,
                         self._draft_s, self._verify_s, ps.fallbacks, ps.reattaches)

    def close(self) -> None:
        self.proposer.close()
