"""The KV hand-off of disaggregated prefill/decode: the engine-side state of a request whose prompt
is computed on one worker and decoded on another (the wire is workers/kv/transfer.py, the RPCs
workers/handoff/disagg.py). It drives the block manager and the runner; the engine only asks it.

  prefill side  ``mark_export(seq, first_block)``: the request produces just its first token (its
                params are narrowed to one token, no stop rules), then at finish
                ``export(seq, first_token)`` copies out the model-wide K/V of prompt blocks
                first_block.. (the ones the decode side does not hold) with the sampling
                generator's state. The engine then frees everything like any finished request.
  decode side   ``reserve(seq)`` takes the prefix-cache hits and allocates blocks for the rest of
                the prompt -> a KVTicket (which blocks to send); ``complete(id, ticket, kv, state)``
                writes the received blocks, restores the generator to where the prefill side left
                it and hands the sequence back, prompt computed, for the engine to append the first
                token and decode on. ``release(id)`` forgets a request (finished or aborted; the
                engine frees its blocks).
Sampling continues exactly: the first token is drawn on the prefill side from the request's seeded
generator, whose state travels with it, so the decode side's next draw is the one the colocated
engine would make (tests/workers/engine/test_disagg_engine.py checks greedy and seeded).

The two sides may run different parallel shapes (a TP=2 prefill gang, a TP=1 decode worker, an EP
gang...): the runner reads and writes model-wide K/V whatever its shape, so exports are portable.

Worked example (in-process; the engine wraps these calls)::

    ticket = decode.reserve("r1", prompt_ids, params)                 # Engine -> KVHandoff.reserve
    prefill.add_request("r1", prompt_ids, params, export_from_block=ticket.first_block)
    export = ...final output of prefill.step()....kv_export
    decode.import_kv("r1", ticket, export.kv, export.first_token, export.generator_state)
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from workers.engine.block_manager import BlockManager
from workers.errors import InvalidRequestError
from workers.sample.logprobs import TokenLogprob
from workers.engine.runner import KVExport, KVTicket, Runner
from workers.engine.sequence import Sequence


class KVCapacityError(Exception):
    """The decode worker has too few free KV blocks to reserve for this prompt right now."""


class KVHandoff:
    """Prefill exports and decode reservations of one engine (see the module docstring)."""

    def __init__(self, block_manager: BlockManager, runner: Runner) -> None:
        self.block_manager = block_manager
        self.runner = runner
        self._exports: dict[str, int] = {}  # prefill side: request id -> first block to export
        self._reserved: dict[str, Sequence] = {}  # decode side: reserved, waiting for their KV
        self._tickets = itertools.count()

    # ------------------------------------------------------------- prefill side
    def mark_export(self, seq: Sequence, first_block: int) -> None:
        """Make ``seq`` (not yet scheduled) a prefill-only request exporting blocks first_block..
        Raises InvalidRequestError when the decode side already holds every prompt block."""
        if not 0 <= first_block < self.block_manager.blocks_needed(seq.num_prompt_tokens):
            raise InvalidRequestError("num_cached_tokens", f"decode side holds {first_block} blocks of a "
                                      f"{seq.num_prompt_tokens}-token prompt: nothing left to send")
        # One token, drawn as the colocated engine would draw it: penalties, bias, and min_tokens
        # mask of EOS / stop ids (min_tokens >= 1 <=> the first token may not end the request).
        p = seq.sampling_params
        seq.sampling_params = replace(p, max_tokens=1, min_tokens=min(1, p.min_tokens), stop=())
        self._exports[seq.request_id] = first_block

    def export(self, seq: Sequence, new_token_ids: list[int], aborted: bool,
               first_logprob: TokenLogprob | None = None) -> KVExport | None:
        """At finish (before the blocks are freed): the export of a marked request, None otherwise
        (or when it was aborted). Forgets the request either way."""
        first_block = self._exports.pop(seq.request_id, None)
        if first_block is None or aborted:
            return None
        table = self.block_manager.block_table(seq.request_id)
        end = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        return KVExport(new_token_ids[0], first_block, self.runner.read_blocks(table[first_block:end]),
                        self.runner.generator_state(seq.request_id), first_logprob)

    # -------------------------------------------------------------- decode side
    def reserve(self, seq: Sequence) -> KVTicket:
        """Take prefix-cache hits and allocate blocks for the rest of ``seq``'s prompt.
        Raises KVCapacityError if the blocks are not free (nothing is kept then)."""
        bm = self.block_manager
        cached = bm.match_prefix(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * bm.block_size
        if not bm.allocate(seq, seq.num_prompt_tokens - seq.num_computed_tokens, cached):
            raise KVCapacityError(f"{bm.blocks_needed(seq.num_prompt_tokens) - len(cached)} KV blocks "
                                  f"needed, {bm.num_free_blocks} free")
        self._reserved[seq.request_id] = seq
        total = bm.blocks_needed(seq.num_prompt_tokens)
        return KVTicket(f"{seq.request_id}@{next(self._tickets)}", len(cached), total - len(cached),
                        seq.num_cached_tokens)

    def complete(self, request_id: str, ticket: KVTicket, kv: torch.Tensor, generator_state: bytes | None) -> Sequence:
        """Write a reservation's received blocks (kv [L, 2, n, bs, G, D], already verified), mark
        the prompt computed and restore the generator. Returns the sequence, no longer reserved."""
        seq = self._reserved.pop(request_id)
        assert kv.shape[2] == ticket.num_blocks, "transfer size was verified against the ticket"
        table = self.block_manager.block_table(request_id)
        self.runner.write_blocks(table[ticket.first_block : ticket.first_block + ticket.num_blocks], kv)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.cache_computed_blocks(seq)  # later prompts with this prefix hit here
        if generator_state is not None and seq.sampling_params.seed is not None:
            self.runner.set_generator_state(request_id, generator_state)
        return seq

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def reserved(self) -> list[Sequence]:
        """Sequences holding reserved blocks while their KV is in transit."""
        return list(self._reserved.values())

    def release(self, request_id: str) -> None:
        """Forget a request that ended (its blocks are the engine's to free)."""
        self._reserved.pop(request_id, None)
        self._exports.pop(request_id, None)
