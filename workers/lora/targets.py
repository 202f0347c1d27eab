"""What an adapter may target: PEFT's module names, the fused projection each lands in, and shapes.

The model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (workers/layers/linear.py),
so a PEFT module is a *part* of one of four projections per decoder layer:

    PEFT module          projection  part      rows of the projection's output
    q_proj k_proj v_proj qkv         q k v     offsets of the fused qkv_proj
    o_proj               o           o         all
    gate_proj up_proj    gate_up     gate up   offsets of the fused gate_up_proj
    down_proj            down        down      all

``ProjectionShape`` gives a projection's input width and its parts' output rows; a model reports
the projections each layer can take (``LlamaForCausalLM.lora_targets``): the attention of the
Llama family and its dense MLPs (an MoE layer's experts and MLA attention take none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# PEFT module name -> (projection, part)
PEFT_MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "q"),
    "k_proj": ("qkv", "k"),
    "v_proj": ("qkv", "v"),
    "o_proj": ("o", "o"),
    "gate_proj": ("gate_up", "gate"),
    "up_proj": ("gate_up", "up"),
    "down_proj": ("down", "down"),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
PART_ORDER: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"),
                                          "down": ("down",)}


@dataclass(frozen=True)
class ProjectionShape:
    """One projection of one layer: input width and each part's (first output row, rows)."""

    in_features: int
    parts: tuple[tuple[str, int, int], ...]  # (part, first row, rows), in output order

    @property
    def out_features(self) -> int:
        return sum(n for _, _, n in self.parts)

    def part(self, name: str) -> tuple[int, int]:
        for p, start, n in self.parts:
            if p == name:
                return start, n
        raise KeyError(name)

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    def part_index(self, name: str) -> int:
        return [p for p, _, _ in self.parts].index(name)


# layer index -> projection -> shape
LoraTargets = dict[int, dict[str, ProjectionShape]]


def projection_shape(layer: Any, projection: str) -> ProjectionShape:
    """The shape of ``layer`` (a Linear / QuantLinear, fused or not) as ``projection``."""
    in_features = int(layer.in_features)
    offsets = getattr(layer, "offsets", None)
    if offsets:
        parts = tuple((p, *offsets[p]) for p in PART_ORDER[projection])
    else:
        (part,) = PART_ORDER[projection]
        parts = ((part, 0, int(layer.out_features)),)
    return ProjectionShape(in_features, parts)


def peft_module_names() -> str:
    return ", ".join(PEFT_MODULES)
