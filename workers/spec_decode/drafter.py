"""DraftEngine: a small LM that drafts tokens for many requests at once, each with its own paged KV.

It runs inside a drafter replica (drafter_service.py) and is driven by diffs (drafter.proto): per
request it holds a context (prompt + output the target accepted, then its own drafts) and the KV of
all but the last held token. An item rolls the context back to ``keep`` tokens (the ones the target
confirmed), appends the new ones, and drafts ``num_tokens`` tokens. With ``full_context`` (or
``keep`` 0) the item carries the whole context and the engine keeps the longest common prefix of
what it holds and that context: a request that moved to another target (P/D hand-off, migration,
a resume) or whose target reconnected keeps its drafter KV, nothing recomputed.

Continuous batching. ``add`` queues an item (a request's next item waits behind its current one,
so one request's items apply in order); ``step`` runs ONE batched forward pass over every queued
item: each computes the tokens not yet in its KV (a prompt's chunk on the first item, usually 1-2
tokens later) and, once it is at the end of its context, samples one draft. An item is done when it
has its drafts (or hits the context limit, or the KV pool is full), so items that arrive while
others are mid-way join at the next position: the rounds of every target sharing this replica run
as one batch. Rolled-back tokens' blocks go back to the pool (``BlockManager.trim``).

Memory. A request's state stays until it is released (the target finished or aborted it), or has
had no item for ``expire(idle_s)``'s idle_s (its target died, or it moved somewhere that never came
back). Under pressure -- a block allocation fails -- idle requests' KV is evicted, least recently
used first: their tokens stay, and their next item re-prefills them (``evictions``).

With ``draft_vocab_size`` the drafter scores only the most frequent tokens and each request's own
context tokens (draft_vocab.py): drafts stay inside that set and verification keeps the output exact.
``vocab_limit`` (per item, the target's vocabulary) keeps drafts to ids the target scores.

Sampling follows the target's rule per request (workers/sample/rejection_sampler.py's
``target_probs``): greedy requests get argmax drafts, others draw from q with the request's draft
generator and the distributions q travel back for the rejection rule.

Worked example (k = 3): held [p1..p9] + drafts [a b c] (KV of p1..p9 a b). The target accepted a b
and replaced c with x. Next item: keep 11 (p1..p9 a b), new [x] -> compute x, draft d, e, f.

Axes: N requests sampling in a pass, V vocabulary, P pruned vocabulary, K drafts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import set_cpu_kernels_enabled
from workers.config import CacheConfig, EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.device import resolve_for_process
from workers.engine.model_runner import ModelRunner, kv_bytes_per_block
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.models.checkpoint import checkpoint_dir
from workers.models.loader import load_model
from workers.sample.rejection_sampler import target_probs
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_vocab import ContextVocab, PrunedHead, draft_token_ids, expand

logger = logging.getLogger(__name__)

MAX_STEP_TOKENS = 512  # prompt tokens one forward pass computes at most (decodes always run)


@dataclass(frozen=True)
class DraftItem:
    request_id: str
    keep: int
    new_token_ids: list[int]
    num_tokens: int  # drafts wanted; 0 = prefetch (compute the context's KV only)
    params: SamplingParams
    full_context: bool = False  # new_token_ids is the whole context (keep 0 means the same)
    held_len: int = 0  # what the target believes is held (keep > 0 only); another count -> resync; 0 = unchecked
    vocab_limit: int = 0  # drafts are ids below this; 0 = the drafter's vocabulary


@dataclass(eq=False)
class DraftResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] each, sampled requests only
    resync: bool = False
    done: bool = False


@dataclass(frozen=True)
class DraftStats:
    """Counters since start (the drafter's DrafterLoad)."""

    items: int
    draft_tokens: int
    forward_passes: int
    batched_rows: int  # requests summed over forward passes
    tokens_computed: int  # context tokens run through the model (prompts, re-prefills, accepted tokens)
    compute_seconds: float
    evictions: int
    expired: int
    releases: int
    resyncs: int


@dataclass(eq=False)
class _Job:
    seq: Sequence
    item: DraftItem
    result: DraftResult


class DraftEngine:
    """config: the drafter's engine settings (model = the draft checkpoint, quantization, KV budget);
    vocab_size: the target's (drafts are ids both know; None = the drafter's); draft_vocab_size:
    score only this many of the most frequent tokens (0 = all)."""

    def __init__(self, config: EngineConfig, vocab_size: int | None = None, draft_vocab_size: int = 0, *,
                 max_step_tokens: int = MAX_STEP_TOKENS, clock: Callable[[], float] = time.monotonic) -> None:
        path = checkpoint_dir(config.model)
        config = resolve_for_process(config, path)
        if not config.cpu_kernels:
            set_cpu_kernels_enabled(False)  # process-wide: the drafter replica runs one engine
        model, spec = load_model(path, config.torch_dtype, config.device, config.quantization,
                                 fused_decode=config.fused_decode, prepack_weights=config.prepack_weights,
                                 quantized_batches=config.quantized_batches)
        bs = config.cache.block_size
        num_blocks = config.cache.num_blocks or config.cache.kv_cache_memory_bytes // kv_bytes_per_block(
            spec, bs, config.kv_dtype)
        self.model_path = path
        self.spec = spec
        self.max_len = min(spec.max_position_embeddings, num_blocks * bs)
        # The target's vocabulary may be padded differently: drafts must be ids both models know.
        self.vocab_size = min(spec.vocab_size, vocab_size or spec.vocab_size)
        self.max_step_tokens = max_step_tokens
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        self.runner = ModelRunner(model, spec, config, num_blocks)
        self.head: PrunedHead | None = None
        if 0 < draft_vocab_size < self.vocab_size:
            ids = draft_token_ids(path, self.vocab_size, draft_vocab_size)
            self.head = PrunedHead(model, ids, config.quantization)
            logger.info("drafter head pruned to %d of %d tokens (%s)", len(ids), self.vocab_size, config.quantization)
        self._clock = clock
        self._seqs: dict[str, Sequence] = {}  # every request holding state (tokens, maybe KV)
        self._last_used: dict[str, float] = {}
        self._vocabs: dict[str, ContextVocab] = {}  # pruned head: each request's own context tokens
        self._gens: dict[str, torch.Generator] = {}
        self._default_gen = torch.Generator().manual_seed(config.seed)
        self._jobs: dict[str, _Job] = {}  # the item each request is working on (insertion = arrival order)
        self._waiting: dict[str, deque[tuple[DraftItem, DraftResult]]] = {}  # items behind a request's job
        self._done: list[DraftResult] = []  # finished outside a pass (resyncs, releases), returned by step
        self._counts = dict(items=0, draft_tokens=0, forward_passes=0, batched_rows=0, tokens_computed=0, evictions=0,
                            expired=0, releases=0, resyncs=0)
        self._compute_s = 0.0
        logger.info("drafter ready: %s, %d KV blocks x %d tokens", path, num_blocks, bs)

    @classmethod
    def for_target(cls, draft_model: str, quantization: str, target: EngineConfig,
                   target_vocab_size: int | None = None, draft_vocab_size: int = 0) -> DraftEngine:
        """A private drafter for ``target`` (``private_drafter_config``)."""
        return cls(private_drafter_config(draft_model, quantization, target), target_vocab_size, draft_vocab_size)

    # ------------------------------------------------------------------ calls
    def add(self, item: DraftItem) -> DraftResult:
        """Queue ``item``; its result is filled in by later ``step`` calls (``done`` when complete)."""
        res = DraftResult(item.request_id)
        self._counts["items"] += 1
        if item.request_id in self._jobs:
            self._waiting.setdefault(item.request_id, deque()).append((item, res))
        else:
            self._start(item, res)
        return res

    @property
    def has_work(self) -> bool:
        return bool(self._jobs or self._done)

    def step(self) -> list[DraftResult]:
        """One batched forward pass over every queued item; returns the results completed since
        the last call (in no particular order)."""
        t0 = time.perf_counter()
        done: list[DraftResult] = []
        chunks, sampling = self._schedule(done)
        if chunks:
            self._forward(chunks, sampling, done)
        done.extend(self._done)
        self._done = []
        self._compute_s += time.perf_counter() - t0
        return done

    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        """``items`` (distinct requests or not) to completion, in-process: their results in order."""
        results = [self.add(item) for item in items]
        while not all(r.done for r in results):
            self.step()
        return results

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: free its state now (an item in progress or waiting
        completes with what it has)."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            self._complete(job.result, self._done)
        for _, res in self._waiting.pop(request_id, ()):
            self._complete(res, self._done)
        if self._drop(request_id):
            self._counts["releases"] += 1

    def expire(self, idle_s: float) -> int:
        """Free the requests with no item for ``idle_s`` seconds; returns how many."""
        cutoff = self._clock() - idle_s
        stale = [rid for rid, t in self._last_used.items() if t < cutoff and rid not in self._jobs]
        for rid in stale:
            self._drop(rid)
        self._counts["expired"] += len(stale)
        if stale:
            logger.info("drafter: %d requests idle for %.0f s freed", len(stale), idle_s)
        return len(stale)

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    @property
    def num_active(self) -> int:
        return len(self._jobs)

    def stats(self) -> DraftStats:
        return DraftStats(compute_seconds=self._compute_s, **self._counts)

    # --------------------------------------------------------------- helpers
    def _drop(self, request_id: str) -> bool:
        self._gens.pop(request_id, None)
        self._vocabs.pop(request_id, None)
        self._last_used.pop(request_id, None)
        self.block_manager.free(request_id)
        return self._seqs.pop(request_id, None) is not None

    def _start(self, item: DraftItem, res: DraftResult) -> None:
        seq = self._sync(item)
        self._last_used[item.request_id] = self._clock()
        if seq is None:
            res.resync = True
            self._counts["resyncs"] += 1
            self._complete(res, self._done)
        else:
            self._jobs[item.request_id] = _Job(seq, item, res)

    def _complete(self, res: DraftResult, done: list[DraftResult]) -> None:
        res.done = True
        done.append(res)

    def _finish(self, job: _Job, done: list[DraftResult]) -> None:
        """A job is complete: hand back its result and start the request's next item, if any."""
        rid = job.item.request_id
        del self._jobs[rid]
        self._last_used[rid] = self._clock()
        self._complete(job.result, done)
        waiting = self._waiting.get(rid)
        while waiting and rid not in self._jobs:  # (an item that resyncs at once lets the next one start)
            self._start(*waiting.popleft())
        if waiting is not None and not waiting:
            del self._waiting[rid]

    def _sync(self, item: DraftItem) -> Sequence | None:
        """Roll the request's context back to what the item keeps and append the rest; None if the
        state the diff is based on is gone (nothing held, or not ``held_len`` tokens)."""
        rid = item.request_id
        seq = self._seqs.get(rid)
        if item.full_context or item.keep == 0:
            ctx = item.new_token_ids
            if not ctx:
                return None
            if seq is None:
                seq = Sequence(rid, list(ctx), item.params, 0)
                self._seqs[rid] = seq
                if item.params.seed is not None:
                    self._gens[rid] = torch.Generator().manual_seed(item.params.seed)
                return seq
            keep, new = _common_prefix(seq.token_ids, ctx), ctx
        else:
            if seq is None or item.keep > seq.num_tokens or (item.held_len and item.held_len != seq.num_tokens):
                self._drop(rid)
                return None
            keep, new = item.keep, None
        del seq.token_ids[keep:]
        if rid in self._vocabs:
            self._vocabs[rid].rewind(keep)
        seq.token_ids.extend(new[keep:] if new is not None else item.new_token_ids)
        if not seq.token_ids:
            self._drop(rid)
            return None
        seq.sampling_params = item.params
        seq.num_computed_tokens = min(seq.num_computed_tokens, keep, seq.num_tokens - 1)
        self.block_manager.trim(rid, seq.num_computed_tokens)
        return seq

    def _schedule(self, done: list[DraftResult]) -> tuple[list[ScheduledChunk], list[_Job]]:
        """This pass's chunks: every job's uncomputed tokens (prompts within MAX_STEP_TOKENS), and
        the jobs that sample a draft (at the end of their context and wanting more)."""
        budget = self.max_step_tokens
        chunks, sampling = [], []
        for job in list(self._jobs.values()):
            seq, want = job.seq, job.item.num_tokens
            end = seq.num_tokens - (1 if want == 0 else 0)  # a prefetch leaves the last token for the next item
            n = end - seq.num_computed_tokens
            if (want == 0 and n <= 0) or (want > 0 and (len(job.result.token_ids) >= want
                                                        or seq.num_tokens >= self.max_len)):
                self._finish(job, done)
                continue
            take = n if n == 1 else min(n, budget)
            if take <= 0:
                continue  # the pass is full of prompt tokens: next pass
            if not self._allocate(seq, take):
                self._finish(job, done)  # the KV pool is full even after evictions: fewer drafts
                continue
            if take > 1:
                budget -= take
            sample = want > 0 and take == n
            chunks.append(ScheduledChunk(seq.request_id, seq.token_ids[seq.num_computed_tokens:
                                                                       seq.num_computed_tokens + take],
                                         seq.num_computed_tokens, list(self.block_manager.block_table(seq.request_id)),
                                         sample=sample))
            if sample:
                sampling.append(job)
        return chunks, sampling

    def _allocate(self, seq: Sequence, n: int) -> bool:
        """Blocks for n more tokens, evicting idle requests' KV (least recently used first) if needed."""
        if self.block_manager.allocate(seq, n):
            return True
        for rid in sorted((r for r in self._last_used if r not in self._jobs), key=self._last_used.__getitem__):
            if not self.block_manager.num_held_blocks(rid):
                continue
            self.block_manager.free(rid)
            self._seqs[rid].num_computed_tokens = 0  # its tokens stay: the next item re-prefills them
            self._counts["evictions"] += 1
            if self.block_manager.allocate(seq, n):
                return True
        return False

    @torch.inference_mode()
    def _forward(self, chunks: list[ScheduledChunk], sampling: list[_Job], done: list[DraftResult]) -> None:
        hidden, rows = self.runner.forward(SchedulerOutput(chunks))
        self._counts["forward_passes"] += 1
        self._counts["batched_rows"] += len(chunks)
        self._counts["tokens_computed"] += sum(len(c.token_ids) for c in chunks)
        for c in chunks:
            self._seqs[c.request_id].num_computed_tokens += len(c.token_ids)
        if not sampling:
            return
        row_of = {rid: r for r, rid in rows}  # the runner orders rows its own way (decodes first)
        hidden = hidden[[row_of[j.seq.request_id] for j in sampling]]  # [N, E]
        greedy, logits = self._logits(hidden, sampling)
        for row, job in enumerate(sampling):
            seq, params, res = job.seq, job.item.params, job.result
            if params.greedy:
                token = greedy[row]
            else:
                assert logits is not None  # returned whenever a row samples
                q = target_probs(logits[row : row + 1], params)[0]  # [V]
                token = int(torch.multinomial(q, 1, generator=self._gens.get(seq.request_id, self._default_gen)))
                res.probs.append(q)
            seq.append_token(token)
            res.token_ids.append(token)
            self._counts["draft_tokens"] += 1
            if len(res.token_ids) >= job.item.num_tokens:
                self._finish(job, done)

    def _logits(self, hidden: torch.Tensor, jobs: list[_Job]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy drafts of every row and (for sampled requests) logits [N, V], -inf at ids a
        request's target cannot score (vocab_limit) and, with a pruned head, outside its scored ids."""
        limits = [j.item.vocab_limit if 0 < j.item.vocab_limit < self.vocab_size else self.vocab_size for j in jobs]
        if self.head is None:
            full = self.runner.model.compute_logits(hidden)
            assert full is not None  # a drafter is one rank
            logits = full[:, : self.vocab_size]  # [N, V]
            for row, limit in enumerate(limits):
                if limit < self.vocab_size:
                    logits[row, limit:] = float("-inf")
            return logits.argmax(-1).tolist(), logits
        contexts = []
        for job in jobs:
            ctx = self._vocabs.setdefault(job.seq.request_id, ContextVocab(self.head))
            ctx.update(job.seq.token_ids)
            contexts.append(ctx)
        scored = self.head.score(hidden, contexts)  # per row: (ids [S], logits [S])
        scored = [(ids, lg.masked_fill(ids >= limit, float("-inf")) if limit < self.vocab_size else lg)
                  for (ids, lg), limit in zip(scored, limits)]
        greedy = [int(ids[lg.argmax()]) for ids, lg in scored]
        if all(j.item.params.greedy for j in jobs):
            return greedy, None
        return greedy, torch.stack([expand(ids, lg, self.vocab_size) for ids, lg in scored])  # [N, V]


def private_drafter_config(draft_model: str, quantization: str, target: EngineConfig) -> EngineConfig:
    """A worker's own drafter: on ``target.speculative.drafter_device`` (SpeculativeConfig.drafter_placement)
    with the target's block size and a KV budget of a quarter of the target's (its model is small),
    no lower KV tiers (a small model's prefix is cheaper to recompute than to keep)."""
    cache = CacheConfig(block_size=target.cache.block_size,
                        kv_cache_memory_bytes=max(target.cache.kv_cache_memory_bytes // 4, 16 << 20),
                        host_tier_bytes=0)
    device, dtype = target.speculative.drafter_placement(target.device, target.dtype)
    return EngineConfig(model=draft_model, dtype=dtype, device=device, quantization=quantization, seed=target.seed,
                        cache=cache, fused_decode=target.fused_decode, cpu_kernels=target.cpu_kernels)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
