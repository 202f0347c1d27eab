"""DraftEngine: a small LM that drafts tokens for many requests, each with its own paged KV.

It runs inside the drafter actor (drafter_service.py) and is driven by diffs (drafter.proto): per
request it holds a context (prompt + output the target accepted, then its own drafts) and the KV of
all but the last held token. A call rolls the context back to ``keep`` tokens (the ones the target
confirmed), appends the new ones, and drafts: the first position computes every token not yet in
its KV (a whole prompt on the first call, usually 1-2 tokens later) and samples a draft; each
further position is one batched single-token decode over the requests still drafting. Rolled-back
tokens' blocks go back to the pool (``BlockManager.trim``); rejected drafts cost nothing more.

With ``draft_vocab_size`` the drafter scores only the most frequent tokens and each request's own
context tokens (draft_vocab.py): drafts stay inside that set and verification keeps the output exact.

Sampling follows the target's rule per request (workers/sample/rejection_sampler.py's
``target_probs``): greedy requests get argmax drafts, others draw from q with the request's draft
generator and the distributions q travel back for the rejection rule.

Worked example (k = 3): held [p1..p9] + drafts [a b c] (KV of p1..p9 a b). The target accepted a b
and replaced c with x. Next call: keep 11 (p1..p9 a b), new [x] -> compute x, draft d, e, f.

Axes: N requests drafting at this position, V vocabulary, P pruned vocabulary, K drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels import set_cpu_kernels_enabled
from workers.engine.block_manager import BlockManager
from workers.config import CacheConfig, EngineConfig
from workers.engine.model_runner import ModelRunner, kv_bytes_per_block
from workers.engine.device import resolve_for_process
from workers.models.checkpoint import checkpoint_dir
from workers.models.loader import load_model
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.spec_decode.draft_vocab import ContextVocab, PrunedHead, draft_token_ids, expand
from workers.sample.rejection_sampler import target_probs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftItem:
    request_id: str
    keep: int
    new_token_ids: list[int]
    num_tokens: int  # drafts wanted; 0 = prefetch (compute the context's KV only)
    params: SamplingParams


@dataclass
class DraftResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] each, sampled requests only
    resync: bool = False


class DraftEngine:
    """config: the drafter's engine settings (model = the draft checkpoint, quantization, KV budget);
    vocab_size: the target's (drafts are ids both know); draft_vocab_size: score only this many of
    the most frequent tokens (0 = all)."""

    def __init__(self, config: EngineConfig, vocab_size: int | None = None, draft_vocab_size: int = 0) -> None:
        path = checkpoint_dir(config.model)
        config = resolve_for_process(config, path)
        if not config.cpu_kernels:
            set_cpu_kernels_enabled(False)  # process-wide: the drafter actor runs one engine
        model, spec = load_model(path, config.torch_dtype, config.device, config.quantization,
                                 fused_decode=config.fused_decode)
        bs = config.cache.block_size
        num_blocks = config.cache.num_blocks or config.cache.kv_cache_memory_bytes // kv_bytes_per_block(
            spec, bs, config.torch_dtype)
        self.spec = spec
        self.max_len = min(spec.max_position_embeddings, num_blocks * bs)
        # The target's vocabulary may be padded differently: drafts must be ids both models know.
        self.vocab_size = min(spec.vocab_size, vocab_size or spec.vocab_size)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        self.runner = ModelRunner(model, spec, config, num_blocks)
        self.head: PrunedHead | None = None
        if 0 < draft_vocab_size < self.vocab_size:
            ids = draft_token_ids(path, self.vocab_size, draft_vocab_size)
            self.head = PrunedHead(model, ids, config.quantization)
            logger.info("drafter head pruned to %d of %d tokens (%s)", len(ids), self.vocab_size, config.quantization)
        self._seqs: dict[str, Sequence] = {}
        self._vocabs: dict[str, ContextVocab] = {}  # pruned head: each request's own context tokens
        self._gens: dict[str, torch.Generator] = {}
        self._default_gen = torch.Generator().manual_seed(config.seed)
        logger.info("drafter ready: %s, %d KV blocks x %d tokens", path, num_blocks, bs)

    @classmethod
    def for_target(cls, draft_model: str, quantization: str, target: EngineConfig,
                   target_vocab_size: int | None = None, draft_vocab_size: int = 0) -> DraftEngine:
        """A drafter on ``target.speculative.drafter_device`` (see SpeculativeConfig.drafter_placement)
        with the target's block size and a KV budget of a quarter of the target's (its model is small)."""
        cache = CacheConfig(block_size=target.cache.block_size,
                            kv_cache_memory_bytes=max(target.cache.kv_cache_memory_bytes // 4, 16 << 20))
        device, dtype = target.speculative.drafter_placement(target.device, target.dtype)
        return cls(EngineConfig(model=draft_model, dtype=dtype, device=device,
                                quantization=quantization, seed=target.seed, cache=cache,
                                fused_decode=target.fused_decode, cpu_kernels=target.cpu_kernels), target_vocab_size,
                   draft_vocab_size)

    # ------------------------------------------------------------------ calls
    def propose(self, items: list[DraftItem]) -> list[DraftResult]:
        results, active = [], []
        for item in items:
            res = DraftResult(item.request_id)
            results.append(res)
            seq = self._sync(item)
            if seq is None:
                res.resync = True
            elif item.num_tokens == 0:
                self._prefetch(seq)
            else:
                active.append((seq, item, res))
        for _ in range(max((item.num_tokens for _, item, _ in active), default=0)):
            active = [(s, i, r) for s, i, r in active if len(r.token_ids) < i.num_tokens and self._room(s)]
            if not active:
                break
            self._draft_position(active)
        return results

    def release(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self._gens.pop(request_id, None)
        self._vocabs.pop(request_id, None)
        self.block_manager.free(request_id)

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # --------------------------------------------------------------- helpers
    def _sync(self, item: DraftItem) -> Sequence | None:
        """Roll the request's context back to ``keep`` tokens and append the new ones; None if the
        state is gone (keep > 0 but nothing held, or fewer tokens held than keep)."""
        if item.keep == 0:  # a whole context: start afresh (new request, or a resend after a loss)
            self.release(item.request_id)
        seq = self._seqs.get(item.request_id)
        if seq is None:
            if item.keep or not item.new_token_ids:
                return None
            seq = Sequence(item.request_id, list(item.new_token_ids), item.params, 0)
            self._seqs[item.request_id] = seq
            if item.params.seed is not None:
                self._gens[item.request_id] = torch.Generator().manual_seed(item.params.seed)
            return seq
        if item.keep > seq.num_tokens:
            self.release(item.request_id)
            return None
        del seq.token_ids[item.keep :]
        if item.request_id in self._vocabs:
            self._vocabs[item.request_id].rewind(item.keep)
        seq.token_ids.extend(item.new_token_ids)
        seq.sampling_params = item.params
        seq.num_computed_tokens = min(seq.num_computed_tokens, item.keep, seq.num_tokens - 1)
        self.block_manager.trim(seq.request_id, seq.num_computed_tokens)
        return seq

    def _room(self, seq: Sequence) -> bool:
        """One more position fits the context limit and the KV pool (else the request stops drafting)."""
        n = seq.num_tokens - seq.num_computed_tokens
        return seq.num_tokens < self.max_len and self.block_manager.allocate(seq, n)

    def _prefetch(self, seq: Sequence) -> None:
        """Compute the KV of every held token but the last (the next call's first position does it)."""
        n = seq.num_tokens - 1 - seq.num_computed_tokens
        if n <= 0 or not self.block_manager.allocate(seq, n):
            return
        self._run([ScheduledChunk(seq.request_id, seq.token_ids[seq.num_computed_tokens : seq.num_tokens - 1],
                                  seq.num_computed_tokens, list(self.block_manager.block_table(seq.request_id)),
                                  sample=False)])
        seq.num_computed_tokens = seq.num_tokens - 1

    @torch.inference_mode()
    def _draft_position(self, active: list[tuple[Sequence, DraftItem, DraftResult]]) -> None:
        """One forward pass: every active request computes its uncomputed tokens and draws a draft."""
        chunks = []
        for seq, _, _ in active:
            start = seq.num_computed_tokens
            chunks.append(ScheduledChunk(seq.request_id, seq.token_ids[start:], start,
                                         list(self.block_manager.block_table(seq.request_id)), sample=True))
        hidden = self._run(chunks)  # [N, E]
        if self.head is None:
            logits = self.runner.model.compute_logits(hidden)[:, : self.vocab_size]  # [N, V]
            greedy = logits.argmax(-1).tolist()
        else:
            greedy, logits = self._pruned(hidden, active)
        for row, (seq, item, res) in enumerate(active):
            seq.num_computed_tokens = seq.num_tokens
            if item.params.greedy:
                token = greedy[row]
            else:
                q = target_probs(logits[row : row + 1], item.params)[0]  # [V]
                token = int(torch.multinomial(q, 1, generator=self._gens.get(seq.request_id, self._default_gen)))
                res.probs.append(q)
            seq.append_token(token)
            res.token_ids.append(token)

    def _pruned(self, hidden: torch.Tensor, active) -> tuple[list[int], torch.Tensor | None]:
        """Greedy drafts and (for sampled requests) full-vocabulary logits [N, V], -inf outside each
        request's scored ids: the kept ones and its context's."""
        head = self.head
        contexts = []
        for seq, _, _ in active:
            ctx = self._vocabs.setdefault(seq.request_id, ContextVocab(head))
            ctx.update(seq.token_ids)
            contexts.append(ctx)
        scored = head.score(hidden, contexts)  # per row: (ids [S], logits [S])
        greedy = [int(ids[lg.argmax()]) for ids, lg in scored]
        if all(item.params.greedy for _, item, _ in active):
            return greedy, None
        return greedy, torch.stack([expand(ids, lg, self.vocab_size) for ids, lg in scored])  # [N, V]

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        hidden, rows = self.runner.forward(SchedulerOutput(chunks))
        if not rows:
            return torch.empty(0)
        return hidden[[r for r, _ in rows]]  # [N, E]: the sampled rows
