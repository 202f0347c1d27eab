"""SwiGLU gate: silu(gate) * up on the fused [gate | up] projection (``kernels.silu_and_mul``)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.silu_and_mul import silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2I] -> [T, I]
        return silu_and_mul(x)
