"""Phi-3 / Phi-4 (``phi3``): the Llama decoder; the checkpoint stores q/k/v as one ``qkv_proj``
[(H + 2G) D, E] and gate/up as one ``gate_up_proj`` [2I, E], split here as they stream in so each
part lands in this rank's shard of the fused layers (tensor parallel shards by head and by MLP
width, which the stored order does not follow). LongRoPE scaling lives in workers/layers/rotary.py.

Axes: E hidden, H query heads, G kv heads, D head dim, I MLP width.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        s = self.spec
        qkv = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv, dim=0)):
                    yield name.replace(".qkv_proj.", f".{part}."), t
            elif ".mlp.gate_up_proj." in name:
                for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=0)):
                    yield name.replace(".gate_up_proj.", f".{part}."), t
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, str | None]]:
        return super().load_weights(self._split(weights))
