"""Mixtral: the Llama decoder with a sparse MoE MLP (workers/layers/moe.py) in every layer; also
the loader every sparse-MoE model here shares (Qwen2-MoE subclasses it: workers/models/qwen2_moe.py).

Checkpoint formats, all read:
  - transformers 5 in memory / fused files: ``model.layers.N.mlp.gate.weight`` [E, H] (router),
    ``model.layers.N.mlp.experts.gate_up_proj`` [E, 2I, H] ([gate; up] rows per expert) and
    ``model.layers.N.mlp.experts.down_proj`` [E, H, I];
  - per-expert tensors, which is also what transformers 5.23's ``save_pretrained`` writes:
    Mixtral's ``model.layers.N.block_sparse_moe.experts.J.{w1,w3,w2}.weight`` (gate [I, H], up [I, H],
    down [H, I]) with the router at ``block_sparse_moe.gate.weight``, and Qwen2-MoE's
    ``model.layers.N.mlp.experts.J.{gate_proj,up_proj,down_proj}.weight``.
With expert parallelism each rank keeps only its own experts' weights (the rest are skipped while
streaming the checkpoint).

Axes: T tokens, H hidden, I expert MLP width, E experts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from workers.errors import CheckpointError
from workers.layers.moe import SparseMoE
from workers.models.config import ModelSpec
from workers.models.llama import LlamaForCausalLM
from workers.parallel.groups import get_group

_PER_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_KIND = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
         "gate_up_proj": "gate_up"}


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, spec: ModelSpec, quantization: str = "none") -> None:
        if quantization != "none":  # the experts run the grouped GEMM on float weights only
            raise CheckpointError(f"quantization={quantization!r} is not supported for {spec.model_type} (MoE) "
                                  "models yet; use quantization 'none'")
        super().__init__(spec, quantization)

    def make_mlp(self, spec: ModelSpec, layer_idx: int) -> nn.Module:
        assert spec.num_experts > 0 and spec.num_experts_per_tok > 0, "a MoE config names its experts"
        return SparseMoE(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.num_experts_per_tok,
                         get_group("ep"), spec.norm_topk_prob)

    def moe_layers(self) -> list[SparseMoE]:
        """The sparse MoE MLPs, in layer order (layers with a dense MLP are skipped)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def _moe_by_layer(self) -> dict[int, SparseMoE]:
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoE)}

    def expected_weights(self) -> set[tuple[str, str | None]]:
        keys = {k for k in super().expected_weights() if ".mlp.experts." not in k[0]}
        for i, moe in self._moe_by_layer().items():
            keys.update((f"model.layers.{i}.mlp.experts", s) for s in moe.expected_shards())
        return keys

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, str | None]]:
        loaded: set[tuple[str, str | None]] = set()
        moes = self._moe_by_layer()

        def dense() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _PER_EXPERT.match(name) or _FUSED.match(name)
                if m is None:
                    yield name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor
                    continue
                layer = int(m.group(1))
                expert = int(m.group(2)) if m.re is _PER_EXPERT else None
                moe = moes.get(layer)
                if moe is None or (expert is not None and expert >= moe.num_experts):
                    raise KeyError(name)
                shards = moe.load_expert(_KIND[m.group(m.re.groups)], tensor, expert)
                loaded.update((f"model.layers.{layer}.mlp.experts", s) for s in shards)

        loaded |= super().load_weights(dense())
        return loaded
