"""ModelRunner: SchedulerOutput -> one forward pass -> sampled tokens (RunnerOutput).

Owns the model, the KV cache tensors and per-request sampling state (params, generator). It turns
the scheduler's lists (token ids, start positions, block tables) into tensors once per step:
flat input ids and positions, the cache slot of every new token, and the attention metadata that
every layer shares. Logits are computed only for rows that are sampled.

Axes: T tokens in the step, B single-token chunks, L context, S cache slots, G kv heads, D head dim.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from workers.config import EngineConfig
from workers.layers.attention import AttentionMetadata, PrefillSpan
from workers.layers.sampler import Sampler
from workers.models.config import ModelSpec
from workers.sampling_params import SamplingParams
from workers.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> next token, for chunks with sample=True


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: nn.Module, spec: ModelSpec, config: EngineConfig, num_blocks: int) -> None:
        self.model = model
        self.spec = spec
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        slots = num_blocks * self.block_size
        # [layers, 2, S, G, D]; zeros, not empty: padded gathers read unused slots, which are masked
        # out, but NaN garbage would still poison the masked softmax.
        self.kv_cache = torch.zeros(
            spec.num_layers, 2, slots, spec.num_kv_heads, spec.head_dim, dtype=config.torch_dtype, device=self.device
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler()
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._block_offsets = torch.arange(self.block_size)  # metadata is built on CPU, then moved

    # ---------------------------------------------------------- request state
    def add_request(self, request_id: str, params: SamplingParams) -> None:
        self._params[request_id] = params
        if params.seed is not None:
            self._generators[request_id] = torch.Generator(device="cpu").manual_seed(params.seed)

    def remove_request(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._generators.pop(request_id, None)

    def generator_state(self, request_id: str) -> bytes | None:
        """The request's own sampling generator state (None without a seed), for hand-over."""
        gen = self._generators.get(request_id)
        return None if gen is None else bytes(gen.get_state().tolist())

    def set_generator_state(self, request_id: str, state: bytes) -> None:
        gen = self._generators.get(request_id)
        assert gen is not None, f"{request_id} has no seeded generator"
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    # ------------------------------------------------------------- KV blocks
    def _blocks_view(self) -> torch.Tensor:
        L, _, S, G, D = self.kv_cache.shape
        return self.kv_cache.view(L, 2, S // self.block_size, self.block_size, G, D)  # [L, 2, NB, bs, G, D]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the given blocks' K/V: [L, 2, n, bs, G, D]."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return self._blocks_view().index_select(2, ids)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Overwrite the given blocks with kv [L, 2, n, bs, G, D] (from ``read_blocks`` elsewhere)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self._blocks_view().index_copy_(2, ids, kv.to(device=self.device, dtype=self.kv_cache.dtype))

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        hidden, sample_rows = self.forward(sched)  # [T, E]
        if not sample_rows:
            return RunnerOutput({})
        rows, ids = zip(*sample_rows)
        logits = self.model.compute_logits(hidden[list(rows)])  # [N, V]
        params = [self._params[r] for r in ids]
        gens = [self._generators.get(r, self._default_generator) for r in ids]
        tokens = self.sampler(logits, params, gens)
        return RunnerOutput(dict(zip(ids, tokens)))

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """Run the model over the step's tokens and write their KV: hidden [T, E] and the
        (row, request id) pairs to sample. Ranks of a gang that do not sample call only this."""
        # Single-token chunks (decodes) go first: they share one batched attention call.
        singles = [c for c in sched.chunks if len(c.token_ids) == 1]
        multis = [c for c in sched.chunks if len(c.token_ids) > 1]
        input_ids, positions, meta, sample_rows = self._prepare(singles + multis, len(singles))
        return self.model(input_ids, positions, self.kv_caches, meta), sample_rows

    def _context_slots(self, table: list[int], end: int) -> torch.Tensor:
        """Cache slots of token positions [0, end) of a sequence with this block table: [end]."""
        bt = torch.tensor(table[: -(-end // self.block_size)], dtype=torch.long)
        return (bt[:, None] * self.block_size + self._block_offsets).view(-1)[:end]

    def _prefill_span(self, c: ScheduledChunk, row: int) -> PrefillSpan:
        """The plain (SDPA) path's view of a prefill chunk at rows [row, row + n) of the step."""
        n = len(c.token_ids)
        if c.start_pos == 0:
            return PrefillSpan(row, row + n, None, None)
        end = c.start_pos + n
        mask = torch.arange(end)[None, :] <= torch.arange(c.start_pos, end)[:, None]  # [n, L]
        ctx = self._context_slots(c.block_table, end)
        return PrefillSpan(row, row + n, ctx.to(self.device), mask.to(self.device))

    def _tables(self, tables: list[list[int]], lens: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Block tables padded with 0 to [N, max_blocks] int32 and context lengths [N] int32 (None if N = 0)."""
        if not tables:
            return None, None
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return (
            torch.tensor(padded, dtype=torch.int32, device=self.device),
            torch.tensor(lens, dtype=torch.int32, device=self.device),
        )

    def _prepare(self, chunks: list[ScheduledChunk], num_singles: int):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, str]] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        prefill_lens: list[int] = []
        prefill_cu: list[int] = [0]
        row = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            end = c.start_pos + n
            table = c.block_table
            ids.extend(c.token_ids)
            pos.extend(range(c.start_pos, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start_pos, end))
            if i < num_singles:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefill_tables.append(table)
                prefill_lens.append(end)
                prefill_cu.append(prefill_cu[-1] + n)
                prefills.append(self._prefill_span(c, row))
            row += n
            if c.sample:
                sample_rows.append((row - 1, c.request_id))
        block_tables, context_lens = self._tables(decode_tables, decode_lens)  # [B, max_blocks], [B]
        prefill_block_tables, prefill_context_lens = self._tables(prefill_tables, prefill_lens)  # [P, .], [P]
        meta = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_singles,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            prefills=prefills,
            prefill_block_tables=prefill_block_tables,
            prefill_cu_seqlens=torch.tensor(prefill_cu, dtype=torch.int32, device=self.device) if prefills else None,
            prefill_context_lens=prefill_context_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        return input_ids, positions, meta, sample_rows
