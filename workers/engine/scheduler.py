"""Token-budget scheduler: continuous batching with stall-free chunked prefill.

Each step has a token budget: ``max_num_batched_tokens``, or with ``target_itl_ms`` what fits in
that time after the step's decodes (workers/engine/token_budget.py; the engine reports every step's
shape and time through ``observe``). The scheduler spends it in this order (Sarathi-Serve's
stall-free batching):
  1. running sequences in decode, oldest first: one token each;
  2. running sequences still in prefill (a long prompt split across steps), oldest first;
  3. waiting sequences, oldest first (preempted ones re-enter at the head of the queue), taking
     their prefix-cache hits and then as large a prompt chunk as the budget allows.
So a long prompt is chunked around the decodes and never stalls them. When the block pool runs
dry, the newest running sequence is preempted: its blocks are freed and it waits to be recomputed
(usually cheaply, from the prefix cache). Admission is FIFO and only the newest is ever preempted,
so no request starves. No new request is admitted in a step that had to preempt.

Speculative decoding: ``schedule(drafts)`` takes draft tokens per decoding request (from
workers/spec_decode/); such a request's chunk is its last token followed by the drafts, computed
in one pass (``num_draft`` rows more to verify). ``commit`` then counts as computed only the last
token and the drafts the runner accepted, and returns the blocks of rejected drafts to the pool.
Drafts are cut to fit the step's token budget, and a preempted request's drafts are dropped.

Sliding windows (``window``, given when *every* layer of the model slides: Mistral, Phi-3 with a
window): after each commit a request's blocks that lie wholly before the window of its next query
go back to the pool (``BlockManager.release_leading``), so a long generation holds about
``window / block_size + 1`` blocks instead of its whole context. The next query is at position
c = num_computed_tokens and sees keys c - window + 1 .. c, so the blocks before
(c - window + 1) // block_size are released. Models that mix sliding and full layers (Gemma 2/3,
Qwen with max_window_layers) keep every block: one block table serves all layers, and the full
layers read the whole context. A prefill-only request whose KV is exported keeps its blocks
(``keep_all_blocks``): the decode side receives, and prefix-caches, every prompt block.

Lower KV tiers (``lower_tiers``, workers/engine/kv_tiers.py): after a waiting sequence's device
prefix hits, the blocks that continue its prefix in host memory are loaded into its newly
allocated blocks instead of computed (a preempted request resumes from them: swap, not recompute).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from workers.engine.block_manager import BlockManager
from workers.config import SchedulerConfig
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.token_budget import TokenBudget, make_budget

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's work in a step: compute ``token_ids`` at positions ``start_pos...``.

    sample: the chunk reaches the end of the sequence's tokens, so a next token is sampled.
    num_draft: speculative decoding: the last num_draft token ids are drafts to verify (logits are
        needed for the last num_draft + 1 rows); 0 for a plain chunk.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_draft: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decode chunks first, then prefill chunks
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def token_split(self) -> tuple[int, int]:
        """(rows of decoding requests: one per decode, 1 + drafts per verify; prompt tokens)."""
        decode = prefill = 0
        for c in self.chunks:
            if c.num_draft or len(c.token_ids) == 1:
                decode += len(c.token_ids)
            else:
                prefill += len(c.token_ids)
        return decode, prefill


class PrefixLoad(Protocol):
    """Blocks a lower tier holds for one admission (workers/engine/kv_tiers.py ``PrefixLoad``)."""

    @property
    def num_blocks(self) -> int: ...

    def write(self, block_ids: list[int]) -> None:
        """Copy the blocks into these (freshly allocated) device blocks."""


class LowerTiers(Protocol):
    def match(self, seq: Sequence, first_block: int, max_blocks: int) -> PrefixLoad | None:
        """The blocks first_block.. (at most max_blocks) of seq's prefix that can be loaded, or None."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, window: int | None = None,
                 budget: TokenBudget | None = None, lower_tiers: LowerTiers | None = None) -> None:
        """window: the model's sliding window when every layer slides (None: keep every block).
        budget: the per-step token budget (default: the one ``config`` asks for).
        lower_tiers: where prefix blocks evicted from the device can be loaded back from (None: off)."""
        assert window is None or window >= 1
        self.config = config
        self.budget = budget or make_budget(config.max_num_batched_tokens, config.target_itl_ms)
        self.block_manager = block_manager
        self.lower_tiers = lower_tiers
        self.window = window
        self._keep_all: set[str] = set()  # requests whose blocks stay until they finish (exports)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0  # since start, for stats and metrics

    # ----------------------------------------------------------- bookkeeping
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in its blocks (imported from a prefill
        worker): it joins the running set in decode, as if this scheduler had prefilled it."""
        assert seq.in_decode, "add_running takes a sequence whose prompt is computed"
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def keep_all_blocks(self, request_id: str) -> None:
        """Never release this request's blocks out of the window (its KV is exported at finish)."""
        self._keep_all.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._keep_all.discard(seq.request_id)
        self.block_manager.free(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (%d tokens to recompute)", seq.request_id, seq.num_tokens)

    # -------------------------------------------------------------- schedule
    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """The step's chunks. drafts: request id -> draft tokens to verify after its last token
        (decoding requests only; cut to the budget)."""
        drafts = drafts or {}
        scheduled: dict[str, int] = {}  # request id -> new tokens, insertion = batch order
        preempted: list[str] = []

        decoding = [s for s in self.running if s.in_decode]
        prefilling = [s for s in self.running if not s.in_decode]
        budget = self.budget.tokens(len(decoding))
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = self.running[-1]
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            else:
                scheduled[seq.request_id] = n
                budget -= n

        # Drafts only after every running request has its token(s), and never at the price of a
        # preemption: they are an optional extension of a decode.
        bm = self.block_manager
        for seq in decoding:
            if seq.request_id not in scheduled or seq.status is not SequenceStatus.RUNNING:
                continue
            room = (len(bm.block_table(seq.request_id)) + bm.num_free_blocks) * bm.block_size - seq.num_tokens
            extra = min(len(drafts.get(seq.request_id, ())), budget, room)
            if extra > 0 and bm.allocate(seq, 1 + extra):
                scheduled[seq.request_id] += extra
                budget -= extra

        max_num_seqs = self.config.max_num_seqs
        assert max_num_seqs is not None  # SchedulerConfig.__post_init__ sets it
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < max_num_seqs
        ):
            seq = self.waiting[0]
            bm = self.block_manager
            cached = bm.match_prefix(seq)  # also speeds up recompute after preemption
            load = (self.lower_tiers.match(seq, len(cached), (seq.num_tokens - 1) // bm.block_size - len(cached))
                    if self.lower_tiers is not None and bm.enable_prefix_caching else None)
            num_loaded = load.num_blocks if load is not None else 0
            seq.num_computed_tokens = (len(cached) + num_loaded) * bm.block_size
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.allocate(seq, n, cached):
                seq.num_computed_tokens = 0
                break
            if load is not None:  # into the blocks just allocated after the device hits
                load.write(bm.block_table(seq.request_id)[len(cached):len(cached) + num_loaded])
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.request_id] = n
            budget -= n

        by_id = {s.request_id: s for s in self.running}
        chunks = []
        for rid, n in scheduled.items():
            seq = by_id[rid]
            start = seq.num_computed_tokens
            num_draft = max(start + n - seq.num_tokens, 0)  # > 0 only for a decode with drafts
            chunks.append(
                ScheduledChunk(
                    request_id=rid,
                    token_ids=seq.token_ids[start : start + n - num_draft] + drafts.get(rid, [])[:num_draft],
                    start_pos=start,
                    block_table=list(self.block_manager.block_table(rid)),
                    sample=start + n >= seq.num_tokens,
                    num_draft=num_draft,
                )
            )
        return SchedulerOutput(chunks=chunks, preempted_ids=preempted)

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        """A step ran (its shape and wall time): feeds the token budget's cost model."""
        self.budget.observe(num_decode_rows, num_prefill_tokens, seconds)

    def commit(self, output: SchedulerOutput, sampled: Mapping[str, list[int]] | None = None) -> None:
        """Advance ``num_computed_tokens`` after the runner has written the chunks' KV.

        sampled: the runner's tokens per request; a chunk with drafts computed its last token plus
        the accepted drafts (len(sampled) - 1 of them: the final token is the target's own and not
        computed yet), and its blocks beyond those tokens go back to the pool (rollback)."""
        by_id = {s.request_id: s for s in self.running}
        for chunk in output.chunks:
            seq = by_id.get(chunk.request_id)
            if seq is None:  # aborted while the step ran
                continue
            if chunk.num_draft:
                assert sampled is not None and chunk.request_id in sampled, "a verified chunk has its tokens"
                seq.num_computed_tokens = chunk.start_pos + len(sampled[chunk.request_id])
                self.block_manager.trim(seq.request_id, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self.block_manager.cache_computed_blocks(seq)
            if self.window is not None and seq.request_id not in self._keep_all:
                first_needed = min(seq.num_computed_tokens, seq.num_tokens) - self.window + 1  # next query's first key
                if first_needed >= self.block_manager.block_size:
                    self.block_manager.release_leading(seq.request_id, first_needed // self.block_manager.block_size)
