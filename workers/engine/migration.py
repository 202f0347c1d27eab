"""Live migration of a running request, engine side: pause it at a step boundary on the source,
take a typed snapshot of its state, reserve and import it on the target, resume it there. The
wire (RPCs, KV transfer) is workers/handoff/migration_service.py; this module never does I/O.

Terms:
    source / target  the worker the request runs on, and the one it moves to.
    snapshot         ``MigrationSnapshot``: everything but the KV that the request's next tokens
                     depend on: prompt and generated token ids, sampling params, the seeded
                     generator's state, the detokenizer's window (stop strings), the speculative
                     draft-length state. Penalty counts and min_tokens progress are functions of
                     the token ids (``num_resumed_tokens`` says which prompt tokens count as
                     generated), so they need no state of their own.
    KV               the K/V of the request's first ``blocks_needed(num_computed_tokens)`` blocks,
                     model-wide (every kv head, whatever the two workers' parallel shapes: a gang's
                     runner gathers and scatters heads, as for prefill -> decode).
    paused           on the source, the request holds its blocks but is out of the scheduler's
                     running set (``SequenceStatus.PAUSED``): no step touches it. Then either
                     ``resume`` (the migration failed: it decodes on here, nothing lost) or
                     ``finish_migrated`` (the target confirmed: everything is freed here, the
                     request's last output says MIGRATED).
    reserved         on the target, a sequence with blocks allocated for the snapshot's computed
                     tokens (prefix-cache hits taken first: only the rest is sent), waiting for
                     its KV; ``complete`` writes the KV and puts it in the running set in decode.

Speculative decoding: an n-gram drafter rebuilds its context from the token ids; a worker's private
drafter re-prefills its own small cache on the target from prompt + generated tokens (the reserve
calls ``prefetch``, as for a disaggregated request, so the drafter works while the KV is in
transit): its KV does not travel. A drafter pool's replica keeps the request's state by request id:
the snapshot names it, the target drafts there from its first step, and the prefetch finds the
context already held (nothing recomputed); the source leaves that state in place. The draft-length
policy's per-request state travels, so a seeded request drafts (and draws) on the target exactly
as on the source.

Structured output: the grammar matcher does not travel either. The target compiles the request's
spec (from its sampling params) while the KV is in transit and parks the request in its
GrammarGate, as a disaggregated decode side does; the new matcher replays the generated tokens
before its first mask (workers/structured/matcher.py: its state is a function of the tokens).

Sequence (S source, T target; each call runs on that engine's thread)::

    snap = S.pause_request("r1")                # PAUSED at a step boundary
    ticket = T.reserve_migration(snap)          # blocks for snap.num_computed_tokens
    kv = S.migration_kv("r1", ticket.first_block)
    T.import_migration("r1", ticket, kv)        # running in decode on T
    S.finish_migrated("r1")                     # frees S's blocks; last output: MIGRATED
    # any failure before import: T.abort("r1"); S.resume_request("r1")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.block_manager import BlockManager
from workers.detokenizer import DetokenizerState, IncrementalDetokenizer
from workers.engine.kv_handoff import KVCapacityError
from workers.engine.runner import KVTicket, Runner
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.proposer import DrafterRef
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.speculator import Speculator


class MigrationError(Exception):
    """This request cannot be migrated now (unknown, finished, not decoding, already paused);
    the message says why. Nothing changed."""


@dataclass(frozen=True)
class MigrationSnapshot:
    """A running request's state at a step boundary, minus its KV (see the module docstring).

    token_ids = prompt_token_ids + output_token_ids; the KV of the first num_computed_tokens of them
    (always num_tokens - 1: the last sampled token is not fed yet) travels separately."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int
    num_resumed_tokens: int = 0
    num_cached_tokens: int = 0
    generator_state: bytes | None = None
    detokenizer: DetokenizerState | None = None
    spec_state: tuple[float, int] | None = None  # (acceptance, steps at zero): draft-length policy
    drafter: DrafterRef | None = None  # the drafter replica it drafts on (a drafter pool's; its state is there)
    adapter: str = ""  # its LoRA adapter ("" = the base model), loaded on the target from adapter_source
    adapter_source: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def check(self) -> None:
        """Internal consistency (a snapshot from a peer); raises MigrationError naming the field."""
        if not self.prompt_token_ids or not self.output_token_ids:
            raise MigrationError("prompt_token_ids and output_token_ids: a migrating request has both")
        if self.num_computed_tokens != len(self.token_ids) - 1:
            raise MigrationError(f"num_computed_tokens: {self.num_computed_tokens}, expected "
                                 f"{len(self.token_ids) - 1} (every token but the last sampled one)")
        if not 0 <= self.num_resumed_tokens < len(self.prompt_token_ids):
            raise MigrationError(f"num_resumed_tokens: {self.num_resumed_tokens} out of range")


class Migration:
    """The migration state of one engine: its paused (source) and reserved (target) requests.
    The engine owns the sequences and detokenizers and passes them in."""

    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, runner: Runner,
                 speculator: Speculator | None = None) -> None:
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.runner = runner
        self.speculator = speculator
        self._paused: dict[str, Sequence] = {}
        self._reserved: dict[str, Sequence] = {}
        self._tickets = 0

    # ------------------------------------------------------------------ source
    def pause(self, seq: Sequence, detok: IncrementalDetokenizer) -> MigrationSnapshot:
        """Take a running, decoding ``seq`` out of the running set (its blocks stay) and snapshot it."""
        if seq.status is SequenceStatus.PAUSED:
            raise MigrationError(f"{seq.request_id} is already being migrated")
        if seq.status is not SequenceStatus.RUNNING or not seq.in_decode:
            raise MigrationError(f"{seq.request_id} is not decoding yet (status {seq.status.value}, "
                                 f"{seq.num_output_tokens} tokens generated): only a decoding request migrates")
        self.scheduler.running.remove(seq)
        seq.status = SequenceStatus.PAUSED
        self._paused[seq.request_id] = seq
        p = seq.sampling_params
        return MigrationSnapshot(
            seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), p, seq.num_computed_tokens,
            seq.num_resumed_tokens, seq.num_cached_tokens,
            self.runner.generator_state(seq.request_id) if p.seed is not None else None, detok.state(),
            self.speculator.request_state(seq.request_id) if self.speculator is not None else None,
            self.speculator.drafter_of(seq.request_id) if self.speculator is not None else None)

    def read_kv(self, request_id: str, first_block: int) -> torch.Tensor:
        """A paused request's K/V of logical blocks first_block.. : [L, 2, n, bs, G, D] (a copy)."""
        seq = self._paused.get(request_id)
        if seq is None:
            raise MigrationError(f"{request_id} is not paused for migration")
        end = self.block_manager.blocks_needed(seq.num_computed_tokens)
        if not 0 <= first_block < end:
            raise MigrationError(f"first_block: {first_block} outside the request's {end} blocks")
        return self.runner.read_blocks(self.block_manager.block_table(request_id)[first_block:end])

    def resume(self, request_id: str) -> bool:
        """Put a paused request back into the running set (the migration failed). False if it is
        no longer paused (it was aborted meanwhile)."""
        seq = self._paused.pop(request_id, None)
        if seq is None:
            return False
        seq.status = SequenceStatus.RUNNING
        self.scheduler.running.append(seq)
        return True

    def take_paused(self, request_id: str) -> Sequence:
        """The paused request, no longer paused: the engine finishes it (MIGRATED) and frees it."""
        seq = self._paused.pop(request_id, None)
        if seq is None:
            raise MigrationError(f"{request_id} is not paused for migration")
        return seq

    def is_paused(self, request_id: str) -> bool:
        return request_id in self._paused

    # ------------------------------------------------------------------ target
    def reserve(self, seq: Sequence, snapshot: MigrationSnapshot) -> KVTicket:
        """Allocate blocks for ``seq`` (built from ``snapshot``, not yet registered) covering its
        computed tokens, prefix-cache hits first. Raises KVCapacityError (nothing kept)."""
        bm = self.block_manager
        cached = bm.match_prefix(seq)  # at most (num_tokens - 1) // bs blocks: all computed
        seq.num_computed_tokens = len(cached) * bm.block_size
        if not bm.allocate(seq, snapshot.num_computed_tokens - seq.num_computed_tokens, cached):
            seq.num_computed_tokens = 0
            raise KVCapacityError(f"{bm.blocks_needed(snapshot.num_computed_tokens) - len(cached)} KV blocks "
                                  f"needed to take over {seq.request_id}, {bm.num_free_blocks} free")
        seq.num_cached_tokens = snapshot.num_cached_tokens
        if self.speculator is not None:  # before the engine's prefetch: the drafter that holds its state
            self.speculator.assign(seq.request_id, snapshot.drafter)
        self._reserved[seq.request_id] = seq
        self._tickets += 1
        total = bm.blocks_needed(snapshot.num_computed_tokens)
        return KVTicket(f"mig/{seq.request_id}@{self._tickets}", len(cached), total - len(cached),
                        len(cached) * bm.block_size)

    def complete(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, snapshot: MigrationSnapshot) -> Sequence:
        """Write the received K/V (kv [L, 2, n, bs, G, D], verified) and restore the sampler and draft
        state. -> the sequence, ready to decode: the engine admits it (to the running set, or first
        to its GrammarGate when it has a grammar matcher)."""
        seq = self._reserved.pop(request_id)
        assert kv.shape[2] == ticket.num_blocks, "transfer size was verified against the ticket"
        table = self.block_manager.block_table(request_id)
        self.runner.write_blocks(table[ticket.first_block : ticket.first_block + ticket.num_blocks], kv)
        seq.num_computed_tokens = snapshot.num_computed_tokens
        self.block_manager.cache_computed_blocks(seq)
        if snapshot.generator_state is not None and seq.sampling_params.seed is not None:
            self.runner.set_generator_state(request_id, snapshot.generator_state)
        if self.speculator is not None and snapshot.spec_state is not None:
            self.speculator.set_request_state(request_id, snapshot.spec_state)
        return seq

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def reserved(self) -> list[Sequence]:
        return list(self._reserved.values())

    def num_paused(self) -> int:
        return len(self._paused)

    def release(self, request_id: str) -> None:
        """Forget a request that ended (aborted while paused or reserved; the engine frees its blocks)."""
        self._paused.pop(request_id, None)
        self._reserved.pop(request_id, None)


def model_fingerprint(engine) -> str:
    """A short id of the model an engine serves (architecture, quantization and a sample of the
    weights): two workers migrate between each other only when theirs agree. Engine thread only."""
    import hashlib

    h = hashlib.sha256(repr(engine.spec).encode())
    h.update(str(engine.config.quantization).encode())
    params = [p for p in engine.runner.model.parameters()] if engine.runner.model is not None else []
    for p in params[:1] + params[-1:]:
        h.update(p.detach().reshape(-1)[:1024].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
