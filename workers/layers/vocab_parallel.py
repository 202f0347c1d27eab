"""Vocabulary-parallel token embedding and LM head (Megatron-LM style).

Each of the tp group's W ranks holds the rows of its vocabulary slice (``vocab_shard``: ceil(V / W)
rows per rank, the last rank's tail zero padding):
  - embedding: a rank looks up the ids in its slice and writes zeros for the others; an
    all-reduce of [T, E] sums the one non-zero row per token, so every rank gets the full embedding;
  - LM head: a rank multiplies the hidden states of the sampled rows only by its rows, giving
    [N, V / W]; a gather to tp rank 0 (the sampler) assembles [N, V], which other ranks never need.
With tied embeddings the head reads the embedding's rows (one copy of the matrix per rank).

Axes: T tokens, N sampled rows, E hidden, V vocabulary, W tp ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import linear, prepack
from workers.parallel import comm
from workers.parallel.groups import GroupCoordinator, get_group
from workers.parallel.sharding import take, vocab_shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp = tp or get_group("tp")
        self.vocab_size = vocab_size
        self.shard = vocab_shard(vocab_size, self.tp.world_size, self.tp.rank)
        self.rows = -(-vocab_size // self.tp.world_size)  # padded rows per rank
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)  # [V / W, E]
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read back by load_weights

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id is None and loaded.shape == (self.vocab_size, param.shape[1]), (loaded.shape, param.shape)
        param.data[: self.shard.size].copy_(take(loaded, 0, self.shard))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, E]
        if self.tp.is_trivial:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)  # [T]
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return comm.all_reduce(h, self.tp)


class ParallelLMHead(nn.Module):
    """logits = hidden W^T over the vocabulary. Untied: its own sharded ``weight`` [V / W, E]
    (checkpoint ``lm_head.weight``); tied: reads the embedding's rows (not registered as a child,
    so the parameter has one name)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied: VocabParallelEmbedding | None = None,
                 tp: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp = tp or get_group("tp")
        self.vocab_size = vocab_size
        self._tied = (tied,) if tied is not None else ()  # a tuple: nn.Module does not register it
        self.packed: torch.Tensor | None = None  # ``prepack``: derived state, never saved or shared
        if tied is None:
            rows = VocabParallelEmbedding(vocab_size, hidden_size, self.tp)
            self.shard = rows.shard
            self.weight = rows.weight  # [V / W, E], loaded through the embedding's loader
            self.weight.weight_loader = rows.weight_loader  # type: ignore[attr-defined]  # read back by load_weights

    def head_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight  # [V / W, E]

    def prepack(self) -> bool:
        """Keep oneDNN's blocked copy of the head's weight (bf16 on the CPU; kernels.linear.prepack);
        True if made. The weight is final by then (tied: the embedding's)."""
        self.packed = prepack(self.head_weight().data)
        return self.packed is not None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] (the sampled rows) -> logits [N, V] on tp rank 0; None on other ranks.
        Collective over the tp group: every tp rank calls it with the same rows."""
        # [N, V / W]: the largest matrix, GEMV kernel at decode sizes
        local = linear(hidden, self.head_weight(), packed=self.packed)
        return gather_vocab_logits(local, self.tp, self.vocab_size)


def gather_vocab_logits(local: torch.Tensor, tp: GroupCoordinator, vocab_size: int) -> torch.Tensor | None:
    """This rank's logits [N, V / W] -> the full [N, V] on tp rank 0 (None on the others); a
    collective of the tp group (the float and the quantized LM heads share it)."""
    if tp.is_trivial:
        return local
    parts = comm.gather_to_first(local, tp)  # W x [N, V / W] on rank 0
    if parts is None:
        return None
    return torch.cat(parts, dim=1)[:, :vocab_size]
