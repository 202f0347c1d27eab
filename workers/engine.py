"""Engine: requests in, token deltas out. ``step()`` is schedule -> run -> postprocess.

Worked example::

    engine = Engine(EngineConfig(model="SmolLM2-135M-Instruct"))
    engine.add_request("r1", "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, repr(out.new_text), out.finish_reason)
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from workers.block_manager import BlockManager, BlockStats
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.errors import InvalidRequestError
from workers.model_runner import ModelRunner, RunnerOutput, kv_bytes_per_block
from workers.models.assets import resolve_model
from workers.models.loader import load_model
from workers.parallel.groups import get_group
from workers.parallel.sharding import attention_shard
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput
from workers.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    blocks: BlockStats


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        path = resolve_model(config.model)
        model, spec = load_model(path, config.torch_dtype, config.device)
        self.spec = spec
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer = tokenizer
        bs = config.cache.block_size
        # Tensor parallel: size the pool by the largest per-rank share of kv heads (rank 0's), so every
        # rank of a gang gets the same block count as the leader's block manager.
        tp = get_group("tp")
        kv_heads = attention_shard(spec.num_heads, spec.num_kv_heads, tp.world_size, 0).kv_heads.size
        num_blocks = config.cache.num_blocks or config.cache.kv_cache_memory_bytes // kv_bytes_per_block(
            spec, bs, config.torch_dtype, kv_heads
        )
        # Context limit: the model's, the user's, and what the whole KV pool can hold (so one
        # request alone always fits and preemption can always make progress).
        self.max_model_len = min(
            config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings, num_blocks * bs
        )
        self.block_manager = BlockManager(num_blocks, bs, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.runner = ModelRunner(model, spec, config, num_blocks)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        logger.info(
            "engine ready: %s, %d KV blocks x %d tokens, max_model_len %d", path, num_blocks, bs, self.max_model_len
        )

    # -------------------------------------------------------------- requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for bad input."""
        request_id = request_id if request_id is not None else f"req-{next(self._arrivals)}"
        if request_id in self._seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{len(ids)} tokens; the limit is {self.max_model_len - 1} (context {self.max_model_len} "
                f"including at least one output token)",
            )
        if any(not 0 <= t < self.spec.vocab_size for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"every id must be in [0, {self.spec.vocab_size})")
        seq = Sequence(request_id, ids, params, next(self._arrivals))
        self._seqs[request_id] = seq
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        self.runner.add_request(request_id, params)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free its KV blocks. Returns its final output, or None if unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        return self._finish(seq, [], "")

    def warm_up(self) -> None:
        """Run one short greedy request (an 8-token prompt, 4 tokens out) through prefill, decode and
        sampling, so the first real request does not pay first-call costs (kernel loading, allocator
        growth, OpenMP thread start: tens of ms). Call it before serving, with nothing in flight.
        The prompt is shorter than a KV block (up to 8 tokens), so it leaves nothing in the prefix
        cache unless blocks are tiny."""
        assert not self._seqs, "warm_up() with requests in flight"
        n = max(1, min(8, self.max_model_len - 5, self.config.cache.block_size - 1))
        rid = self.add_request("__warm_up__", [(i + 1) % self.spec.vocab_size for i in range(n)],
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while rid in self._seqs:
            self.step()
        stats = self.block_manager.stats()
        assert stats.num_free_blocks == stats.num_blocks, "warm-up leaked KV blocks"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), s.num_preemptions, self.block_manager.stats())

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched)
        self.scheduler.commit(sched)
        return self._postprocess(sched, result)

    def _postprocess(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        outputs = []
        for rid, token in result.sampled.items():
            seq = self._seqs[rid]
            seq.append_token(token)
            p = seq.sampling_params
            delta, stopped = self._detok[rid].add(token)
            if stopped or (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                seq.finish_reason = FinishReason.STOP
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
            if seq.finish_reason is not None:
                outputs.append(self._finish(seq, [token], delta))
            else:
                outputs.append(self._output(seq, [token], delta))
        return outputs

    def _finish(self, seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        self.scheduler.remove(seq)
        self.runner.remove_request(seq.request_id)
        delta += self._detok.pop(seq.request_id).flush()
        del self._seqs[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        return self._output(seq, new_ids, delta)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], delta: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=delta,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
