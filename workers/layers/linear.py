"""Linear layers that own their weight loading.

Checkpoints store q/k/v and gate/up as separate matrices; we fuse each group into one matrix so a
step does one GEMM (one pass over the weights) instead of three or two. A fused layer's
``weight_loader(param, loaded, shard_id)`` copies a checkpoint tensor into its rows.
Tensor-parallel variants (issue [parallel]) shard in the same loaders.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import linear


class Linear(nn.Module):
    """y = x W^T (+ b). weight: [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id is None and param.shape == loaded.shape, (param.shape, loaded.shape)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        return linear(x, self.weight, self.bias)  # GEMV kernel at decode sizes, MKL GEMM above


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    ``shards`` maps a shard id (e.g. 'q', 'k', 'v' or 'gate', 'up') to its output size, in order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id in self.offsets, f"unknown shard {shard_id!r}"
        start, size = self.offsets[shard_id]
        dst = param.data.narrow(0, start, size)
        assert dst.shape == loaded.shape, (shard_id, dst.shape, loaded.shape)
        dst.copy_(loaded)
