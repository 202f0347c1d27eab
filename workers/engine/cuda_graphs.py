"""CUDA graphs for decode steps: capture the model's decode forward once per batch size, replay it.

Why: a decode step of a small model on a GPU launches hundreds of tiny kernels (norms, GEMVs,
rotary, attention per layer); at batch 1 the GPU waits on Python and the launch queue, not on
memory. A CUDA graph records the whole kernel sequence once and replays it with one launch.

Terms:
    capture size   a batch size a graph was recorded at (``EngineConfig.cuda_graph_batch_sizes``;
                   default: 1, 2, 4, 8 and multiples of 8 up to ``scheduler.max_num_seqs``).
    static inputs  the tensors a graph reads (token ids, positions, cache slots, block tables,
                   context lengths), allocated once at the largest capture size and
                   ``block_table_width`` = ceil(max_model_len / block_size) blocks wide. A step
                   copies its inputs into their first rows and replays the smallest graph that
                   fits its batch (``pick_capture_size``).
    padding rows   the rows between the step's batch and the capture size: token 0 at position 0,
                   cache slot -1 (the cache-write kernel skips it) and context length 0 (attention
                   writes zeros), so they touch no KV block and cost only their share of the GEMMs.

Worked example: sizes (1, 2, 4, 8), a step with 3 decodes -> the size-4 graph replays; rows 0-2
are the step's, row 3 is padding; the caller reads hidden rows 0-2.

Only decode-only steps (every chunk one token: plain decodes and speculative verify rows) replay;
prefill and mixed steps, and batches larger than the largest capture size, run eagerly. Every
kernel on the decode path must be capturable (no host sync, no allocation that depends on
values): the Triton kernels size their grids from tensor shapes (the block-table width bounds
every context), never from values.

Testing without a GPU: ``DecodeGraphs`` takes a ``graph_factory``; ``EagerReplay`` records the
forward as a closure and re-runs it on replay, so the static-buffer and padding logic is tested on
CPU against the plain path (tests/workers/engine/test_cuda_graphs.py); gpu-check compares real CUDA graphs
with eager decoding token for token.

Axes: B batch (decode rows), P capture size, W block-table width, E hidden.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from workers.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def pick_capture_size(sizes: Sequence[int], batch: int) -> int | None:
    """The smallest capture size >= batch (sizes sorted ascending), or None when none fits."""
    for s in sizes:
        if s >= batch:
            return s
    return None


class Graph(Protocol):
    """What DecodeGraphs needs from a graph: record ``fn`` once, replay it later."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A torch.cuda.CUDAGraph sharing one memory pool with the other capture sizes."""

    def __init__(self, pool: Any) -> None:  # torch.cuda.graph_pool_handle()
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(self._graph, pool=self._pool):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


class EagerReplay:
    """A stand-in graph for CPU tests: replay re-runs the recorded forward into the same output."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def replay(self) -> None:
        assert self._fn is not None and self._out is not None
        self._out.copy_(self._fn())


class DecodeGraphs:
    """Captured decode forwards of one model, one per capture size, over shared static inputs.

    model(input_ids [P], positions [P], kv_caches, meta) -> hidden [P, E] is what is captured.
    """

    def __init__(self, model: nn.Module, kv_caches: list, sizes: Sequence[int], block_size: int,
                 block_table_width: int, device: torch.device,
                 graph_factory: Callable[[], Graph] | None = None) -> None:
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.width = block_table_width
        p = self.sizes[-1]
        self.input_ids = torch.zeros(p, dtype=torch.long, device=device)  # [P]
        self.positions = torch.zeros(p, dtype=torch.long, device=device)  # [P]
        self.slots = torch.full((p,), -1, dtype=torch.long, device=device)  # [P]
        self.block_tables = torch.zeros(p, block_table_width, dtype=torch.int32, device=device)  # [P, W]
        self.context_lens = torch.zeros(p, dtype=torch.int32, device=device)  # [P]
        if graph_factory is None:
            pool = torch.cuda.graph_pool_handle()
            graph_factory = lambda: CudaGraph(pool)  # noqa: E731
        self._graphs: dict[int, Graph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
                graph = graph_factory()
                self._outputs[size] = graph.capture(self._forward_fn(model, kv_caches, size))
                self._graphs[size] = graph
        logger.info("captured decode graphs at batch sizes %s (block tables %d wide)", self.sizes, self.width)

    def _forward_fn(self, model: nn.Module, kv_caches: list, size: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            block_size=self.block_size, slot_mapping=self.slots[:size], num_decodes=size,
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size], prefills=[],
        )
        ids, pos = self.input_ids[:size], self.positions[:size]
        return lambda: model(ids, pos, kv_caches, meta)

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode-only step (the plain path's inputs, B rows) -> hidden [B, E] (a view of the
        graph's output: valid until the next run)."""
        b = input_ids.shape[0]
        size = pick_capture_size(self.sizes, b)
        assert size is not None and meta.num_decodes == b and meta.decode_block_tables is not None
        assert meta.decode_context_lens is not None
        w = meta.decode_block_tables.shape[1]
        if w > self.width:
            raise ValueError(f"block table of {w} blocks exceeds the captured width {self.width}")
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.block_tables[:b, :w].copy_(meta.decode_block_tables)
        self.context_lens[:b].copy_(meta.decode_context_lens)
        if b < size:  # padding rows: write nothing, attend to nothing
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.slots[b:size].fill_(-1)
            self.context_lens[b:size].zero_()
        self._graphs[size].replay()
        return self._outputs[size][:b]

