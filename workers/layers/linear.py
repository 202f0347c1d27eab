"""Linear layers that own their weight loading and, when tensor parallel, their shard and their
collective (Megatron-LM style; shards are decided in workers/parallel/sharding.py).

Checkpoints store q/k/v and gate/up as separate matrices; we fuse each group into one matrix so a
step does one GEMM (one pass over the weights) instead of three or two. A fused layer's
``weight_loader(param, loaded, shard_id)`` copies this rank's rows of a checkpoint tensor into its
part of the fused matrix.

Tensor parallelism over the tp group's W ranks (all identity when W = 1):
  - ``ColumnParallelLinear`` / ``MergedColumnParallelLinear``: each rank holds rows of W (output
    features) and computes its slice of y; no communication. The slice feeds a layer that works on
    it locally (attention heads, the SwiGLU gate) and then a row-parallel layer.
  - ``RowParallelLinear``: each rank holds the matching columns of W (input features), computes a
    partial y_r = x_r W_r^T over its slice of the input, and the layer all-reduces:
    y = sum_r y_r (+ b, added once after the sum).
So a decoder layer costs two all-reduces of [T, E] per step (after o_proj and after down_proj).

Axes: T tokens, E hidden, W tp ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import linear, prepack
from workers.parallel import comm
from workers.parallel.groups import GroupCoordinator, get_group
from workers.parallel.sharding import Shard, even_shard, take


class Linear(nn.Module):
    """y = x W^T (+ b), replicated on every rank. weight: [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read back by load_weights
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read back by load_weights
        else:
            self.register_parameter("bias", None)
        # oneDNN's blocked copy of a bf16 CPU weight (kernels.linear.prepack), made by ``prepack``
        # once the weights are final; a plain attribute, not a buffer: it is derived state, never
        # saved, shared or loaded
        self.packed: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id is None and param.shape == loaded.shape, (param.shape, loaded.shape)
        param.data.copy_(loaded)
        self.packed = None  # the weight changed: a copy made before is stale

    def prepack(self) -> bool:
        """Keep oneDNN's blocked copy of the weight for batches past the GEMV's (bf16 on the CPU
        only); True if made. Call again after changing the weight in place."""
        self.packed = prepack(self.weight.data)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return linear(x, self.weight, self.bias, self.packed)  # GEMV kernel at decode sizes, oneDNN / MKL GEMM above


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input stacked along the output dim, each possibly sharded.

    ``parts`` maps a shard id (e.g. 'q', 'k', 'v' or 'gate', 'up') to this rank's rows of that
    checkpoint matrix, in order; the local matrix stacks those rows. ``offsets[id]`` = (first local
    row, rows). Example (tp=2, gate/up of width 1536): parts {'gate': Shard(768, 768), 'up':
    Shard(768, 768)} on rank 1 -> a [1536, E] local weight, gate rows 768..1535 then up's.
    """

    def __init__(self, in_features: int, parts: dict[str, Shard], bias: bool = False) -> None:
        super().__init__(in_features, sum(s.size for s in parts.values()), bias)
        self.parts = dict(parts)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, shard in parts.items():
            self.offsets[name] = (start, shard.size)
            start += shard.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id in self.offsets, f"unknown shard {shard_id!r}"
        start, size = self.offsets[shard_id]
        dst = param.data.narrow(0, start, size)
        src = take(loaded, 0, self.parts[shard_id])
        assert dst.shape == src.shape, (shard_id, dst.shape, src.shape)
        dst.copy_(src)
        self.packed = None  # the weight changed: a copy made before is stale


class MergedLinear(MergedColumnParallelLinear):
    """The replicated (unsharded) fused projection: ``shards`` maps shard id -> full output size."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, {k: Shard(0, n) for k, n in shards.items()}, bias)


class ColumnParallelLinear(Linear):
    """One matrix split by output rows: rank r holds rows ``shard`` (default: an even split)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: GroupCoordinator | None = None,
                 shard: Shard | None = None) -> None:
        tp = tp or get_group("tp")
        self.shard = shard or even_shard(out_features, tp.world_size, tp.rank)
        super().__init__(in_features, self.shard.size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        super().weight_loader(param, take(loaded, 0, self.shard), shard_id)


class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T) + b: rank r holds input columns ``shard`` of W ([out, shard.size])
    and gets x's matching columns (the output of a column-parallel layer); b is replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: GroupCoordinator | None = None,
                 shard: Shard | None = None) -> None:
        self.tp = tp or get_group("tp")
        self.shard = shard or even_shard(in_features, self.tp.world_size, self.tp.rank)
        super().__init__(self.shard.size, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if param is self.weight:
            loaded = take(loaded, 1, self.shard)
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / W] -> [T, out], the same on every rank
        if self.tp.is_trivial:
            return linear(x, self.weight, self.bias, self.packed)
        y = comm.all_reduce(linear(x, self.weight, packed=self.packed), self.tp)  # [T, out]: sum of the ranks' partials
        return y if self.bias is None else y.add_(self.bias)
