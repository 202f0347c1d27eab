"""Engine: requests in, token deltas out. ``step()`` is schedule -> run -> postprocess.

The engine is built from injected parts (workers/build.py ``build_engine`` assembles today's
single-process one): a Runner (workers/engine/runner.py: ``ModelRunner`` in one process, ``GangRunner`` for a TP / EP /
SP gang), the block manager and scheduler, the KV hand-off (workers/engine/kv_handoff.py) and, when
speculating, a Speculator. It keeps the requests (sequences, detokenizers), ``add_request`` /
``abort`` / ``step`` / ``stats``, and delegates the disaggregated prefill/decode state to the
hand-off:
  prefill side  ``add_request(..., export_from_block=k)``: the final output carries the K/V of
                prompt blocks k.. (``kv_export``).
  decode side   ``reserve(id, prompt, params)`` -> a KVTicket; ``import_kv(id, ticket, kv, ...)``
                writes the received blocks and decodes on after the first token. ``abort(id)``
                returns a reservation's blocks.
Live migration (workers/engine/migration.py): ``pause_request`` / ``migration_kv`` / ``resume_request`` /
``finish_migrated`` on the source, ``reserve_migration`` / ``import_migration`` on the target.
Structured output (``SamplingParams.structured``): the request's grammar compiles on a background
thread (workers/structured/grammar.py, cached per spec) while the request waits in a GrammarGate
(workers/engine/grammar_gate.py) instead of the scheduler; the runner masks each sampled token
with the request's GrammarMatcher, which follows the request's tokens (so preemption, migration, the
disaggregated hand-off and resends need no extra state). A spec that does not compile, or a
grammar that admits no token at some step, ends the request with ``RequestOutput.error``.

Sampling continues exactly: the first token is drawn on the prefill side with the request's full
params from its seeded generator, whose state travels with it; the rest of the sampler state
(penalty counts, min_tokens progress) is a function of the token ids, which the decode side holds
(prompt + first token); the first token's logprobs travel with it.

Worked example::

    engine = build_engine(EngineConfig(model=str(resolve_model("SmolLM2-135M-Instruct"))))
    engine.add_request("r1", "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, repr(out.new_text), out.finish_reason)
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from workers.engine.block_events import BlockEventLog
from workers.engine.block_manager import BlockManager, BlockStats
from workers.config import EngineConfig
from workers.detokenizer import IncrementalDetokenizer, add_batch, batch_decoder
from workers.errors import InvalidRequestError
from workers.engine.kv_handoff import KVCapacityError, KVHandoff
from workers.engine.kv_tiers import KVTiers, TierStats, TierStore
from workers.lora.adapter_set import AdapterSet
from workers.lora.errors import LoraDisabled
from workers.sample.logprobs import TokenLogprob
from workers.engine.migration import Migration, MigrationError, MigrationSnapshot
from workers.engine.runner import KVExport, KVLayout, KVTicket, RequestOutput, Runner, RunnerOutput, RunnerTiming
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from workers.engine.speculator import Speculator, SpecStats
from workers.engine.grammar_gate import GrammarGate
from workers.structured.grammar import GrammarCompiler
from workers.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "KVCapacityError", "KVExport", "KVTicket", "RequestOutput", "StepTiming"]


@dataclass(frozen=True)
class StepTiming:
    """Where one ``step()`` spent its wall-clock time (time.perf_counter seconds), and its shape.

    schedule_s     grammar admissions, drafts (speculative decoding) and the scheduler's choice
    execute_s      the runner: inputs, forward pass, logits, sampling (split in ``runner`` when the
                   runner measures it: workers/engine/runner.py RunnerTiming)
    commit_s       the scheduler's commit (computed tokens, prefix-cache blocks, draft rollback)
    postprocess_s  stop rules, detokenization, the outputs
    num_decode_rows  rows computed for requests past their prompt (one each; verify chunks 1 + drafts)
    num_prefill_tokens  prompt (and recomputed) tokens computed in the step
    On CUDA the runner's parts are launch times until something waits for the device (sampling does).
    """

    schedule_s: float
    execute_s: float
    commit_s: float
    postprocess_s: float
    num_decode_rows: int
    num_prefill_tokens: int
    runner: RunnerTiming | None = None

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.commit_s + self.postprocess_s


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
    tiers: TierStats | None = None  # lower KV tiers (None when off)


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner, tokenizer: Any, *, block_manager: BlockManager | None = None,
                 scheduler: Scheduler | None = None, handoff: KVHandoff | None = None,
                 speculator: Speculator | None = None, migration: Migration | None = None,
                 tier_store: TierStore | None = None, adapters: AdapterSet | None = None) -> None:
        """Assemble an engine from its parts; the defaults build the block manager (sized by the
        runner's ``num_blocks``), the scheduler and the hand-off over them. A runner that cannot
        hold a whole model's KV (one rank of a gang, see workers/engine/runner.py) is refused.
        tier_store: the lower KV tiers (host memory, disk: workers/kv/tiers/), None for none; the
        engine owns it from here (``close``). adapters: the runner's LoRA adapter set (workers/lora/;
        a ModelRunner's ``adapters`` with lora.enabled), None without LoRA: a request naming an adapter
        holds it (``acquire``) from admission until it ends, and runs with its slot."""
        assert runner.kv_layout().holds_all_heads, "an engine's runner holds every kv head (one TP rank does not)"
        self.config = config
        self.runner = runner
        self.spec = runner.spec
        self.tokenizer = tokenizer
        bs = runner.block_size
        # Context limit: the model's, the user's, and what the whole KV pool can hold (so one
        # request alone always fits and preemption can always make progress).
        limit = self.spec.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit, runner.num_blocks * bs)
        events = BlockEventLog()  # one log: the device's blocks (block manager) and the lower tiers' (KVTiers)
        self.tiers = (KVTiers(tier_store, runner, bs, config.cache.tier_load_timeout_s, events=events)
                      if tier_store is not None else None)
        assert self.tiers is None or (block_manager is None and scheduler is None), \
            "with a tier store the engine builds the block manager and scheduler it wires to it"
        self.block_manager = block_manager or BlockManager(runner.num_blocks, bs, config.cache.enable_prefix_caching,
                                                           events=events,
                                                           on_evict=self.tiers.evicted if self.tiers else None)
        self.scheduler = scheduler or Scheduler(config.scheduler, self.block_manager, self.spec.releasable_window,
                                                lower_tiers=self.tiers)
        self.handoff = handoff or KVHandoff(self.block_manager, runner)
        self.speculator = speculator
        self.migration = migration or Migration(self.block_manager, self.scheduler, runner, speculator)
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self.adapters = adapters
        self._lora_slots: dict[str, int] = {}  # request id -> its adapter's slot, from admission to _register
        self._seqs: dict[str, Sequence] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._decode_batch = batch_decoder(tokenizer)  # one tokenizer call per step (workers/detokenizer.py)
        self._matchers: dict[str, GrammarMatcher] = {}  # structured-output requests
        self._arrivals = itertools.count()
        self.last_step: StepTiming | None = None  # the latest step that ran the model
        # structured output: built on the first such request (the llguidance tokenizer takes ~0.5 s)
        self.grammars = GrammarGate(lambda: GrammarCompiler(tokenizer, self.spec.vocab_size,
                                                            sorted(self.eos_token_ids)))

    # -------------------------------------------------------------- requests
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams, *,
                    export_from_block: int | None = None, resumed_output_tokens: int = 0, adapter: str = "") -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for bad input.

        export_from_block: prefill only (disaggregated): produce just the first token (sampled with
        the request's full params: penalties, min_tokens), then put the K/V of prompt blocks
        export_from_block.. on the final output (workers/engine/kv_handoff.py).
        resumed_output_tokens: the prompt's last that many tokens were generated by an earlier run of
        this request (they count as generated for the penalties; see workers/engine/sequence.py).
        adapter: run it with this loaded LoRA adapter ("" = the base model); LoraDisabled without
        LoRA, AdapterNotLoaded when this worker does not hold it (workers/lora/errors.py)."""
        seq = self._new_sequence(request_id, prompt, params, resumed_output_tokens, adapter)
        with self._adapter_held_until_registered(seq):
            if export_from_block is not None:
                self.handoff.mark_export(seq, export_from_block)
                self.scheduler.keep_all_blocks(seq.request_id)  # every exported block must be valid
        matcher = self._register(seq)
        if matcher is not None:
            self.grammars.park(seq, matcher, running=False)  # the scheduler gets it once compiled
        elif not (self.tiers is not None and self.tiers.prefetch(seq)):  # parked: its prefix continues on disk
            self.scheduler.add(seq)
        if self.speculator is not None and export_from_block is None:  # it decodes here: the drafter computes
            self.speculator.prefetch(seq, new=True)                    # its prompt KV while we prefill
        return seq.request_id

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                resumed_output_tokens: int = 0, adapter: str = "") -> KVTicket:
        """Decode side: take prefix-cache hits and allocate blocks for the rest of the prompt.
        Raises InvalidRequestError for bad input, KVCapacityError if the blocks are not free.
        adapter: as ``add_request`` (the prefill worker computes the prompt under the same adapter)."""
        seq = self._new_sequence(request_id, prompt, params, resumed_output_tokens, adapter)
        with self._adapter_held_until_registered(seq):
            ticket = self.handoff.reserve(seq)
        self._register(seq)
        if self.speculator is not None:  # the drafter computes its prompt KV while ours is in transit
            self.speculator.prefetch(seq)
        return ticket

    def import_kv(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, first_token: int,
                  generator_state: bytes | None, first_logprob: TokenLogprob | None = None) -> RequestOutput:
        """Decode side: write a reservation's received blocks (kv [L, 2, n, bs, G, D], already
        verified) and start decoding after ``first_token`` (with its logprobs, if the request asked
        for them). Returns the first token's output."""
        seq = self.handoff.complete(request_id, ticket, kv, generator_state)
        out = self._accept(seq, [first_token], [first_logprob] if first_logprob is not None else None)
        if not out.finished:
            self._start_decoding(seq)
        return out

    def _start_decoding(self, seq: Sequence) -> None:
        """A sequence whose KV has arrived (disaggregated decode, migration target) joins the running
        set; one with a grammar waits in the GrammarGate until it compiles, then its new matcher
        replays the generated tokens before its first mask."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is not None:
            self.grammars.park(seq, matcher, running=True)
        else:
            self.scheduler.add_running(seq)

    def _new_sequence(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                      resumed_output_tokens: int = 0, adapter: str = "") -> Sequence:
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
        if params.structured is not None and not self.eos_token_ids:
            raise InvalidRequestError("structured", "this model declares no EOS token, so a constrained output "
                                      "could never end; set eos_token_id in its config.json")
        if params.structured is not None and params.ignore_eos:
            raise InvalidRequestError("ignore_eos", "cannot be combined with structured output (EOS ends the "
                                      "output where the grammar is complete)")
        if not 0 <= resumed_output_tokens < len(ids):
            raise InvalidRequestError("resumed_output_tokens", f"must be in [0, {len(ids)}) (fewer than the "
                                      f"prompt's tokens), got {resumed_output_tokens}")
        if adapter:  # last: nothing above holds anything; callers release it if they fail before _register
            if self.adapters is None:
                raise LoraDisabled(f"adapter {adapter!r}: this worker runs without LoRA (lora.enabled is false)")
            self._lora_slots[request_id] = self.adapters.acquire(adapter)
        return Sequence(request_id, ids, params, next(self._arrivals), num_resumed_tokens=resumed_output_tokens,
                        adapter=adapter)

    @contextmanager
    def _adapter_held_until_registered(self, seq: Sequence) -> Iterator[None]:
        """Give back the adapter ``_new_sequence`` acquired if admission fails before ``_register``."""
        try:
            yield
        except BaseException:
            if self._lora_slots.pop(seq.request_id, None) is not None:
                assert self.adapters is not None
                self.adapters.release(seq.adapter)
            raise

    def _register(self, seq: Sequence) -> GrammarMatcher | None:
        """Track ``seq``; -> its grammar matcher (compiling) when it asks for structured output."""
        structured = seq.sampling_params.structured
        with self._adapter_held_until_registered(seq):
            matcher = self.grammars.matcher(structured) if structured is not None else None
        self._seqs[seq.request_id] = seq
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                             seq.sampling_params.stop)
        if matcher is not None:
            self._matchers[seq.request_id] = matcher
        slot = self._lora_slots.pop(seq.request_id, -1)
        if slot >= 0:  # (only a LoRA runner takes a slot)
            self.runner.add_request(seq.request_id, seq.sampling_params, seq.token_ids, seq.num_prompt_tokens,
                                    seq.output_start, matcher=matcher, lora_slot=slot)  # type: ignore[call-arg]
        elif matcher is not None:
            self.runner.add_request(seq.request_id, seq.sampling_params, seq.token_ids, seq.num_prompt_tokens,
                                    seq.output_start, matcher=matcher)
        else:  # (runners that predate structured output take no matcher argument)
            self.runner.add_request(seq.request_id, seq.sampling_params, seq.token_ids, seq.num_prompt_tokens,
                                    seq.output_start)
        return matcher

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
        return (self.scheduler.has_unfinished() or len(self.grammars) > 0
                or (self.tiers is not None and (self.tiers.num_parked > 0 or self.tiers.num_pending > 0)))

    def close(self) -> None:
        """Release what outlives a step: the lower KV tiers' thread, files and memory. Idempotent."""
        if self.tiers is not None:
            self.tiers.close()

    def stats(self) -> EngineStats:
        s = self.scheduler
        moe = self.runner.moe_stats()
        parked = self.tiers.num_parked if self.tiers is not None else 0  # waiting for disk KV reads
        return EngineStats(len(s.running), len(s.waiting) + len(self.grammars) + parked, s.num_preemptions,
                           self.block_manager.stats(),
                           expert_tokens=moe.expert_tokens, ep_rank_tokens=moe.ep_rank_tokens,
                           num_reserved=len(self.reserved()),
                           spec=self.speculator.stats() if self.speculator is not None else SpecStats(),
                           tiers=self.tiers.stats() if self.tiers is not None else None)

    def reserved(self) -> list[Sequence]:
        """Decode side (and migration targets): sequences holding reserved blocks while their KV is in transit."""
        return self.handoff.reserved() + self.migration.reserved()

    def kv_layout(self) -> KVLayout:
        """What this engine sends and receives in a disaggregated hand-off: every kv head."""
        return self.runner.kv_layout()

    # ------------------------------------------------------------- migration
    def pause_request(self, request_id: str) -> MigrationSnapshot:
        """Source: hold a decoding request at this step boundary and snapshot it (workers/engine/migration.py).
        Raises MigrationError when it is unknown or not decoding."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise MigrationError(f"{request_id} is not running here (finished, aborted or unknown)")
        if request_id in self.grammars:
            raise MigrationError(f"{request_id} is waiting for its grammar to compile: only a decoding request migrates")
        snapshot = self.migration.pause(seq, self._detok[request_id])
        if seq.adapter:  # the target loads it from the same source before it resumes
            assert self.adapters is not None
            snapshot = replace(snapshot, adapter=seq.adapter, adapter_source=self.adapters.source(seq.adapter))
        return snapshot

    def migration_kv(self, request_id: str, first_block: int) -> torch.Tensor:
        """Source: a paused request's K/V of blocks first_block.. ([L, 2, n, bs, G, D])."""
        return self.migration.read_kv(request_id, first_block)

    def resume_request(self, request_id: str) -> bool:
        """Source: the migration failed; the paused request decodes on here. False if it ended meanwhile."""
        return self.migration.resume(request_id)

    def finish_migrated(self, request_id: str) -> RequestOutput:
        """Source: the target took the request over; free everything here. The final output has
        no tokens and finish reason MIGRATED."""
        seq = self.migration.take_paused(request_id)
        seq.finish_reason = FinishReason.MIGRATED
        return self._finish(seq, [], "")

    def reserve_migration(self, snapshot: MigrationSnapshot) -> KVTicket:
        """Target: register a request from ``snapshot`` and reserve blocks for its KV (prefix hits
        first). Raises InvalidRequestError (bad snapshot, over this engine's limits; the field is
        named), KVCapacityError (no room)."""
        try:
            snapshot.check()
        except MigrationError as e:
            raise InvalidRequestError("migration", str(e)) from None
        seq = self._new_sequence(snapshot.request_id, snapshot.prompt_token_ids, snapshot.params,
                                 snapshot.num_resumed_tokens, snapshot.adapter)
        with self._adapter_held_until_registered(seq):
            if len(snapshot.token_ids) >= self.max_model_len or any(not 0 <= t < self.spec.vocab_size
                                                                    for t in snapshot.output_token_ids):
                raise InvalidRequestError("output_token_ids", f"{len(snapshot.token_ids)} tokens with ids < "
                                          f"{self.spec.vocab_size} needed; this worker's context is "
                                          f"{self.max_model_len}")
            seq.token_ids.extend(snapshot.output_token_ids)
            ticket = self.migration.reserve(seq, snapshot)
        self._register(seq)
        if snapshot.detokenizer is not None:
            self._detok[seq.request_id].restore(snapshot.detokenizer)
        if self.speculator is not None:  # a draft model re-prefills prompt + outputs while the KV is in transit
            self.speculator.prefetch(seq)
        return ticket

    def import_migration(self, request_id: str, ticket: KVTicket, kv: torch.Tensor,
                         snapshot: MigrationSnapshot) -> None:
        """Target: write the received blocks (verified) and decode on from the snapshot's state (a
        structured request once its grammar has compiled and replayed the generated tokens)."""
        self._start_decoding(self.migration.complete(request_id, ticket, kv, snapshot))

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        failed = self._admit_compiled() if len(self.grammars) else []
        if self.tiers is not None:
            for seq in self.tiers.take_ready():  # their disk reads landed in host (or timed out)
                self.scheduler.add(seq)
        spec = self.speculator
        drafts = spec.draft(self.scheduler.running, self.max_model_len) if spec is not None else {}
        sched = self.scheduler.schedule({rid: d.token_ids for rid, d in drafts.items()})
        if sched.is_empty:
            if not failed and len(self.grammars):
                self.grammars.wait(0.01)  # only compiles are left: sleep on them, do not spin
            elif not failed and self.tiers is not None and self.tiers.num_parked:
                self.tiers.wait(0.01)  # only disk reads are left: the same
            return failed
        t1 = time.perf_counter()
        result = self.runner.execute(sched, drafts)
        t2 = time.perf_counter()
        # grammar dead ends end before the commit (which then skips them: they are no longer running)
        failed += [self._fail(self._seqs[rid], error) for rid, error in result.errors.items()]
        self.scheduler.commit(sched, result.sampled)
        if spec is not None:
            spec.record(sched, result.sampled, time.perf_counter() - t1)
        t3 = time.perf_counter()
        outputs = failed + self._postprocess(sched, result)
        decode_rows, prefill_tokens = sched.token_split()
        self.last_step = StepTiming(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, decode_rows, prefill_tokens,
                                    result.timing)
        self.scheduler.observe(decode_rows, prefill_tokens, self.last_step.total_s)
        if self.tiers is not None:
            self.tiers.observe_prefill(prefill_tokens, t2 - t1)
        return outputs

    def _postprocess(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Each sampled request's tokens through the stop rules. The usual one token per request is
        detokenized for all requests at once (one batched decode); a verify's several go one by one."""
        ones = [rid for rid, tokens in result.sampled.items() if len(tokens) == 1]
        texts = dict(zip(ones, add_batch([self._detok[rid] for rid in ones], [result.sampled[rid][0] for rid in ones],
                                         self._decode_batch)))
        return [self._accept(self._seqs[rid], tokens, result.logprobs.get(rid), texts.get(rid))
                for rid, tokens in result.sampled.items()]

    def _admit_compiled(self) -> list[RequestOutput]:
        """Parked structured requests whose grammar compiled join the scheduler; failed ones end."""
        failed = []
        for seq, running, error in self.grammars.take_ready():
            if error is not None:
                failed.append(self._fail(seq, error))
            elif running:
                self.scheduler.add_running(seq)
            else:
                self.scheduler.add(seq)
        return failed

    def _fail(self, seq: Sequence, error: InvalidRequestError) -> RequestOutput:
        """End ``seq`` with ``error`` (finish_reason ABORT; its blocks and state are freed)."""
        logger.info("request %s failed: %s", seq.request_id, error)
        seq.finish_reason = FinishReason.ABORT
        return replace(self._finish(seq, [], ""), error=error)

    def _accept(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None,
                detokenized: tuple[str, bool] | None = None) -> RequestOutput:
        """Append sampled tokens (several after a verify) one by one with the stop rules; finish the
        request at the first that ends it (tokens after it, and their logprobs, are dropped).
        detokenized: the single token's (text, stopped), already added to the request's detokenizer."""
        assert detokenized is None or len(tokens) == 1
        p = seq.sampling_params
        detok = self._detok[seq.request_id]
        new_ids: list[int] = []
        delta = ""
        for token in tokens:
            seq.append_token(token)
            new_ids.append(token)
            text, stopped = detokenized if detokenized is not None else detok.add(token)
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
        export = self.handoff.export(seq, new_ids, aborted=seq.finish_reason is FinishReason.ABORT,
                                     first_logprob=logprobs[0] if logprobs else None)
        self.handoff.release(seq.request_id)
        self.migration.release(seq.request_id)
        if self.speculator is not None:  # a migrated request keeps its (shared) drafter state for the target
            self.speculator.release(seq.request_id, handed_over=seq.finish_reason is FinishReason.MIGRATED)
        self.scheduler.remove(seq)
        self.grammars.discard(seq.request_id)
        if self.tiers is not None:
            self.tiers.release(seq.request_id)
        self._matchers.pop(seq.request_id, None)
        self.runner.remove_request(seq.request_id)
        if seq.adapter:
            assert self.adapters is not None
            self.adapters.release(seq.adapter)
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
