"""Which slice of a weight each tensor-parallel rank owns: the one place that decides shards.

Terms. A *shard* is a contiguous range [start, start + size) of one dimension of a checkpoint
tensor. Column-parallel layers split the output dimension (dim 0 of an HF [out, in] weight),
row-parallel layers the input dimension (dim 1). Layers (and quantized layers, which keep the same
shards of their packed weights) call ``take(tensor, dim, shard)`` in their weight loaders, so each
rank copies only its slice of every checkpoint tensor.

Rules:
  - ``even_shard(n, W, r)``: n units over W ranks, contiguous, the first n % W ranks one larger.
    Example: n = 1536, W = 2 -> [0, 768), [768, 1536); n = 5, W = 2 -> [0, 3), [3, 5).
  - ``attention_shard(H, G, W, r)``: query and kv heads that respect GQA (a query head and its kv
    head live on the same rank). G >= W: the G kv heads split by ``even_shard`` (possibly unevenly)
    and each rank takes the H/G query heads of each of its kv heads. G < W: each kv head is
    replicated on W/G ranks (W must be a multiple of G) which split its query heads evenly.
    Example (SmolLM2: H = 9, G = 3): W = 2 -> rank 0 kv heads [0, 2) and query heads [0, 6),
    rank 1 kv head [2, 3) and query heads [6, 9); W = 3 -> one kv head and three query heads each.
    (9 query heads cannot be split evenly in 2: the uneven split keeps GQA groups whole, at the
    price of rank 0 doing two thirds of the attention.)
  - ``vocab_shard(V, W, r)``: ceil(V / W) rows per rank (the last rank's tail is padding), so
    every rank's logits have the same width and can be gathered with one collective.

Axes: H query heads, G kv heads, W tp ranks, r this rank, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of one dimension (``size`` may be 0 only for padding cases)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def scaled(self, unit: int) -> Shard:
        """The same shard in finer units, e.g. heads -> rows of head_dim each."""
        return Shard(self.start * unit, self.size * unit)


def even_shard(n: int, world: int, rank: int) -> Shard:
    base, extra = divmod(n, world)
    return Shard(rank * base + min(rank, extra), base + (rank < extra))


@dataclass(frozen=True)
class AttentionShard:
    q_heads: Shard
    kv_heads: Shard


def attention_shard(num_heads: int, num_kv_heads: int, world: int, rank: int) -> AttentionShard:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        kv = even_shard(num_kv_heads, world, rank)
        return AttentionShard(kv.scaled(group), kv)
    if world % num_kv_heads or num_heads % world:
        raise ConfigError(
            f"tp_size={world}: with {num_kv_heads} kv heads < tp_size, tp_size must be a multiple of "
            f"{num_kv_heads} and divide the {num_heads} query heads; use tp_size <= {num_kv_heads} or a divisor "
            f"of {num_heads} that is a multiple of {num_kv_heads}")
    per = num_heads // world
    return AttentionShard(Shard(rank * per, per), Shard(rank // (world // num_kv_heads), 1))


def vocab_shard(vocab: int, world: int, rank: int) -> Shard:
    """This rank's vocabulary rows [start, start + size) of a padded width ceil(V / W)."""
    per = -(-vocab // world)
    return Shard(min(rank * per, vocab), max(0, min(per, vocab - rank * per)))


def take(loaded: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor (a view; the loader copies it into the parameter)."""
    assert shard.end <= loaded.shape[dim], (loaded.shape, dim, shard)
    return loaded.narrow(dim, shard.start, shard.size)
