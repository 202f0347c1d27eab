"""Gated MLP activations on the fused [gate | up] projection: SwiGLU silu(gate) * up
(``kernels.silu_and_mul``) and GeGLU gelu_tanh(gate) * up (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.silu_and_mul import silu_and_mul
from workers.errors import ConfigError

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2I] -> [T, I]
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, 2I] -> [T, I]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gated activation named by a checkpoint's hidden_act / hidden_activation."""
    if name == "silu":
        return SiluAndMul()
    if name == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ConfigError(f"hidden_act={name!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
