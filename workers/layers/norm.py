"""RMSNorm: y = r / sqrt(mean(r^2) + eps) * weight, with r = x (+ residual) (Llama, Qwen2).

Called with the residual stream, it fuses the residual add into the norm and returns the new
residual too (one pass, one call: ``kernels.rms_norm``), so a decoder layer reads
``h, residual = norm(h, residual)``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """``offset``: the checkpoint stores weight - offset (Gemma keeps 1 + w with w stored, offset 1);
    the offset is added once as the weight loads, so the kernel always multiplies by the weight."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read back by load_weights

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id is None and param.shape == loaded.shape, (param.shape, loaded.shape)
        param.data.copy_(loaded.float() + self.offset if self.offset else loaded)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # x, residual: [T, E] -> (normed [T, E], x + residual [T, E] or None)
        return rms_norm(x, self.weight, self.eps, residual)
