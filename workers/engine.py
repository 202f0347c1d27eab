"""Engine: requests in, token deltas out. ``step()`` is schedule -> run -> postprocess.

Disaggregated prefill/decode (see workers/kv_transfer.py for the wire side) adds three calls:
  prefill side  ``add_request(..., export_from_block=k)``: compute the prompt as usual (chunked,
                prefix cache), sample the first token with the request's own generator, then copy
                out the K/V of prompt blocks k.. (the ones the decode side does not hold) onto the
                final RequestOutput (``kv_export``) and free everything, like any finished request.
  decode side   ``reserve(id, prompt, params)`` takes the prefix-cache hits and allocates blocks for
                the rest of the prompt -> a KVTicket (which blocks to send); ``import_kv(id, ...)``
                writes the received blocks, restores the sampling generator to where the prefill
                side left it, appends the first token (stop checks as usual) and hands the sequence
                to the scheduler already in decode. ``abort(id)`` returns a reservation's blocks.
Sampling continues exactly: the first token is drawn on the prefill side from the request's
seeded generator, whose state travels with it, so the decode side's next draw is the one the
colocated engine would make (tests/workers/test_disagg_engine.py checks greedy and seeded). The
rest of the sampler state (penalty counts, min_tokens progress) is a function of the token ids,
which the decode side holds (prompt + first token); the first token's logprobs travel with it.

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
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernels import set_cpu_kernels_enabled
from workers.block_manager import BlockManager, BlockStats
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer
from workers.device import resolve_for_process
from workers.errors import ConfigError, InvalidRequestError
from workers.kv_transfer import KVLayout
from workers.layers.logprobs import TokenLogprob
from workers.model_runner import ModelRunner, RunnerOutput, kv_bytes_per_block
from workers.models.assets import resolve_model
from workers.models.loader import load_model
from workers.parallel.groups import get_group
from workers.parallel.sharding import attention_shard
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerOutput
from workers.sequence import FinishReason, Sequence, SequenceStatus
from workers.spec_decode.proposer import Proposer
from workers.spec_decode.speculator import Speculator, SpecStats

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
    kv_export: KVExport | None = None  # prefill side of a disaggregated request, on its final output
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs


@dataclass(frozen=True)
class KVExport:
    """A prefilled request's hand-over: the first token, the sampling generator's state after it
    (None without a seed), the K/V of prompt blocks first_block.. ([L, 2, n, bs, G, D]) and the
    first token's logprobs (None unless asked for)."""

    first_token: int
    first_block: int
    kv: torch.Tensor
    generator_state: bytes | None
    first_logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class KVTicket:
    """A decode-side reservation: the first num_cached_blocks blocks of the prompt were prefix-cache
    hits; blocks first_block..first_block+num_blocks-1 are allocated and wait for the transfer."""

    transfer_id: str
    first_block: int
    num_blocks: int
    num_cached_tokens: int


class KVCapacityError(Exception):
    """The decode worker has too few free KV blocks to reserve for this prompt right now."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    blocks: BlockStats
    expert_tokens: tuple[int, ...] = ()  # MoE: assignments per expert, summed over layers
    ep_rank_tokens: tuple[int, ...] = ()  # MoE: assignments computed per expert-parallel rank
    num_reserved: int = 0  # decode side: reservations waiting for their KV transfer
    spec: SpecStats = SpecStats()  # speculative decoding counters (method "none" when off)


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None, proposer: Proposer | None = None) -> None:
        """proposer: the speculative-decoding drafter; default: built from ``config.speculative``
        (workers/spec_decode/factory.py), none when speculation is off."""
        path = resolve_model(config.model)
        # device/dtype 'auto' -> concrete values; device cuda without CUDA is refused naming the key
        self.config = config = resolve_for_process(config, path)
        if config.device.startswith("cuda") and get_group("gang").world_size > 1:
            raise ConfigError(f"device={config.device!r} in a tensor/expert/sequence-parallel gang: gang collectives "
                              "do not carry CUDA tensors yet (NCCL gang groups are not wired); set the pool's "
                              "engine.device to cpu")
        if not config.cpu_kernels:
            set_cpu_kernels_enabled(False)  # process-wide: this process runs one engine
        model, spec = load_model(path, config.torch_dtype, config.device, config.quantization,
                                 fused_decode=config.fused_decode)
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
        if config.cuda_graphs:
            self.runner.capture_graphs(self.max_model_len)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._exports: dict[str, int] = {}  # prefill side: request id -> first block to export
        self._reserved: dict[str, Sequence] = {}  # decode side: reserved, waiting for their KV
        if proposer is None and config.speculative.enabled:
            from workers.spec_decode.factory import make_proposer

            proposer = make_proposer(config.speculative, config, spec.vocab_size)
        self.speculator = Speculator(proposer, config.speculative) if proposer is not None else None
        logger.info(
            "engine ready: %s, %d KV blocks x %d tokens, max_model_len %d", path, num_blocks, bs, self.max_model_len
        )

    # -------------------------------------------------------------- requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams, *,
                    export_from_block: int | None = None, resumed_output_tokens: int = 0) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for bad input.

        export_from_block: prefill only (disaggregated): produce just the first token (sampled with
        the request's full params: penalties, min_tokens), then put the K/V of prompt blocks
        export_from_block.. on the final output (see the module docstring).
        resumed_output_tokens: the prompt's last that many tokens were generated by an earlier run of
        this request (they count as generated for the penalties; see workers/sequence.py)."""
        seq = self._new_sequence(request_id, prompt, params, resumed_output_tokens)
        if export_from_block is not None:
            if not 0 <= export_from_block < self.block_manager.blocks_needed(seq.num_prompt_tokens):
                raise InvalidRequestError("num_cached_tokens", f"decode side holds {export_from_block} blocks of a "
                                          f"{seq.num_prompt_tokens}-token prompt: nothing left to send")
            # One token, drawn as the colocated engine would draw it: penalties, bias, and min_tokens
            # mask of EOS / stop ids (min_tokens >= 1 <=> the first token may not end the request).
            seq.sampling_params = replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens), stop=())
            self._exports[seq.request_id] = export_from_block
        self._register(seq)
        self.scheduler.add(seq)
        return seq.request_id

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                resumed_output_tokens: int = 0) -> KVTicket:
        """Decode side: take prefix-cache hits and allocate blocks for the rest of the prompt.
        Raises InvalidRequestError for bad input, KVCapacityError if the blocks are not free."""
        seq = self._new_sequence(request_id, prompt, params, resumed_output_tokens)
        cached = self.block_manager.match_prefix(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_manager.block_size
        if not self.block_manager.allocate(seq, seq.num_prompt_tokens - seq.num_computed_tokens, cached):
            raise KVCapacityError(f"{self.block_manager.blocks_needed(seq.num_prompt_tokens) - len(cached)} KV blocks "
                                  f"needed, {self.block_manager.num_free_blocks} free")
        self._register(seq)
        self._reserved[request_id] = seq
        if self.speculator is not None:  # the drafter computes its prompt KV while ours is in transit
            self.speculator.prefetch(seq)
        total = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        return KVTicket(f"{request_id}@{next(self._arrivals)}", len(cached), total - len(cached), seq.num_cached_tokens)

    def import_kv(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, first_token: int,
                  generator_state: bytes | None, first_logprob: TokenLogprob | None = None) -> RequestOutput:
        """Decode side: write a reservation's received blocks (kv [L, 2, n, bs, G, D], already
        verified) and start decoding after ``first_token`` (with its logprobs, if the request asked
        for them). Returns the first token's output."""
        seq = self._reserved.pop(request_id)
        assert kv.shape[2] == ticket.num_blocks, "transfer size was verified against the ticket"
        table = self.block_manager.block_table(request_id)
        self.runner.write_blocks(table[ticket.first_block : ticket.first_block + ticket.num_blocks], kv)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_computed_blocks(seq)  # later prompts with this prefix hit here
        if generator_state is not None and seq.sampling_params.seed is not None:
            self.runner.set_generator_state(request_id, generator_state)
        logprobs = [first_logprob] if first_logprob is not None else None
        out = self._accept(seq, [first_token], logprobs)
        if not out.finished:
            self.scheduler.add_running(seq)
        return out

    def _new_sequence(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                      resumed_output_tokens: int = 0) -> Sequence:
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
        params.check_vocab(self.spec.vocab_size)
        if not 0 <= resumed_output_tokens < len(ids):
            raise InvalidRequestError("resumed_output_tokens", f"must be in [0, {len(ids)}) (fewer than the "
                                      f"prompt's tokens), got {resumed_output_tokens}")
        return Sequence(request_id, ids, params, next(self._arrivals), num_resumed_tokens=resumed_output_tokens)

    def _register(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                             seq.sampling_params.stop)
        self.runner.add_request(seq.request_id, seq.sampling_params, seq.token_ids, seq.num_prompt_tokens,
                                seq.output_start)

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
        moe = getattr(self.runner.model, "moe_layers", None)
        experts = ranks = ()
        if moe is not None:
            layers = moe()
            experts = tuple(sum(layer.expert_counts for layer in layers).tolist())
            ranks = tuple(sum(layer.rank_rows for layer in layers).tolist())
        return EngineStats(len(s.running), len(s.waiting), s.num_preemptions, self.block_manager.stats(),
                           expert_tokens=experts, ep_rank_tokens=ranks, num_reserved=len(self._reserved),
                           spec=self.speculator.stats() if self.speculator is not None else SpecStats())

    def reserved(self) -> list[Sequence]:
        """Decode side: sequences holding reserved blocks while their KV is in transit."""
        return list(self._reserved.values())

    def kv_layout(self) -> KVLayout:
        spec = self.spec
        return KVLayout(spec.num_layers, self.block_manager.block_size, spec.num_kv_heads, spec.head_dim,
                        self.config.torch_dtype)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        spec = self.speculator
        drafts = spec.draft(self.scheduler.running, self.max_model_len) if spec is not None else {}
        sched = self.scheduler.schedule({rid: d.token_ids for rid, d in drafts.items()})
        if sched.is_empty:
            return []
        t0 = time.perf_counter()
        result = self.runner.execute(sched, drafts)
        self.scheduler.commit(sched, result.sampled)
        if spec is not None:
            spec.record(sched, result.sampled, time.perf_counter() - t0)
        return self._postprocess(sched, result)

    def _postprocess(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        return [self._accept(self._seqs[rid], tokens, result.logprobs.get(rid))
                for rid, tokens in result.sampled.items()]

    def _accept(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Append sampled tokens (several after a verify) one by one with the stop rules; finish the
        request at the first that ends it (tokens after it, and their logprobs, are dropped)."""
        p = seq.sampling_params
        detok = self._detok[seq.request_id]
        new_ids: list[int] = []
        delta = ""
        for token in tokens:
            seq.append_token(token)
            new_ids.append(token)
            text, stopped = detok.add(token)
            delta += text
            if stopped or (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                seq.finish_reason = FinishReason.STOP
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
            if seq.finish_reason is not None:
                return self._finish(seq, new_ids, delta, logprobs and logprobs[: len(new_ids)])
        return self._output(seq, new_ids, delta, logprobs=logprobs)

    def _finish(self, seq: Sequence, new_ids: list[int], delta: str,
                logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        export = None
        first_block = self._exports.pop(seq.request_id, None)
        if first_block is not None and seq.finish_reason is not FinishReason.ABORT:
            table = self.block_manager.block_table(seq.request_id)
            end = self.block_manager.blocks_needed(seq.num_prompt_tokens)
            export = KVExport(new_ids[0], first_block, self.runner.read_blocks(table[first_block:end]),
                              self.runner.generator_state(seq.request_id), logprobs[0] if logprobs else None)
        self._reserved.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        self.scheduler.remove(seq)
        self.runner.remove_request(seq.request_id)
        delta += self._detok.pop(seq.request_id).flush()
        del self._seqs[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        return self._output(seq, new_ids, delta, export, logprobs)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], delta: str, export: KVExport | None = None,
                logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=delta,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            kv_export=export,
            new_logprobs=logprobs,
        )
