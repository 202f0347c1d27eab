"""Mixtral: the Llama decoder with a sparse MoE MLP (workers/layers/moe.py) in every layer.

Checkpoint formats, both read:
  - transformers 5 in memory / fused files: ``model.layers.N.mlp.gate.weight`` [E, H] (router),
    ``model.layers.N.mlp.experts.gate_up_proj`` [E, 2I, H] ([gate; up] rows per expert) and
    ``model.layers.N.mlp.experts.down_proj`` [E, H, I];
  - the classic per-expert layout, which is also what transformers 5.23's ``save_pretrained``
    writes for Mixtral: ``model.layers.N.block_sparse_moe.gate.weight`` and
    ``model.layers.N.block_sparse_moe.experts.J.{w1,w3,w2}.weight`` (gate [I, H], up [I, H], down [H, I]).
With expert parallelism each rank keeps only its own experts' weights (the rest are skipped while
streaming the checkpoint).

Axes: T tokens, H hidden, I expert MLP width, E experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from workers.layers.moe import SparseMoE
from workers.models.config import ModelSpec
from workers.models.llama import LlamaForCausalLM
from workers.parallel.groups import get_group

_LEGACY_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_KIND = {"w1": "gate", "w3": "up", "w2": "down", "gate_up_proj": "gate_up", "down_proj": "down"}


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, spec: ModelSpec) -> nn.Module:
        assert spec.num_experts > 0 and spec.num_experts_per_tok > 0, "a Mixtral config names its experts"
        return SparseMoE(spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.num_experts_per_tok,
                         get_group("ep"))

    def moe_layers(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.model.layers]

    def expected_weights(self) -> set[tuple[str, str | None]]:
        keys = {k for k in super().expected_weights() if ".mlp.experts." not in k[0]}
        for i, moe in enumerate(self.moe_layers()):
            keys.update((f"model.layers.{i}.mlp.experts", s) for s in moe.expected_shards())
        return keys

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, str | None]]:
        loaded: set[tuple[str, str | None]] = set()
        moes = self.moe_layers()

        def dense() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LEGACY_EXPERT.match(name) or _FUSED_EXPERT.match(name)
                if m is None:
                    yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
                    continue
                prefix = m.group(1)
                expert = int(m.group(2)) if m.re is _LEGACY_EXPERT else None
                layer = int(prefix.rsplit(".", 1)[1])
                if layer >= len(moes) or (expert is not None and expert >= moes[layer].num_experts):
                    raise KeyError(name)
                shards = moes[layer].load_expert(_KIND[m.group(m.re.groups)], tensor, expert)
                loaded.update((f"{prefix}.mlp.experts", s) for s in shards)

        loaded |= super().load_weights(dense())
        return loaded
