"""LoraStacks: every adapter slot's weights, stacked per layer and projection for kernels/lora.py.

For each (layer, projection) that a model can adapt (workers/lora/targets.py) the stacks hold

    a [S, P R, in]    slot s's lora_A of part p in rows [p R, p R + r)
    b [S, out, P R]   slot s's lora_B of part p in rows part_rows(p), columns [p R, p R + r)

(P the projection's parts: 3 for qkv, 2 for gate_up, else 1), zero elsewhere. So the fused qkv
projection applies its q, k and v adapters in one batched LoRA of rank 3R whose B is block
diagonal: a part an adapter does not target, and the padding of a rank below R, add exactly 0.
``scales[s]`` is slot s's lora_alpha / r (or / sqrt(r)).

Buffers are allocated for a projection when the first adapter targeting it is placed (an engine
whose adapters touch only q and v pays for qkv alone) and are float32 on the model's device. Cost:
per slot and projection P R (in + out) floats, e.g. SmolLM2-135M at R = 16 with all seven modules
targeted: 7.3M floats (29 MB) per slot over its 30 layers.

Per step the runner calls ``begin_step(slots)`` with each token's slot (-1 = base): the grouping
(kernels/lora.py ``lora_groups``) is computed once and every projection of every layer reuses it;
a step without adapter tokens sets none, and ``apply`` then costs one attribute check.

Axes: S slots, R max rank, P parts, T tokens in the step.
"""

from __future__ import annotations

import torch

from kernels.lora import LoraGroups, lora, lora_groups
from workers.lora.reader import LoraAdapter
from workers.lora.targets import PEFT_MODULES, LoraTargets


class LoraStacks:
    def __init__(self, targets: LoraTargets, num_slots: int, max_rank: int, device: torch.device | str) -> None:
        self.targets = targets
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=self.device)  # [S]
        self._a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, projection) -> [S, P R, in]
        self._b: dict[tuple[int, str], torch.Tensor] = {}  # (layer, projection) -> [S, out, P R]
        self._step: LoraGroups | None = None

    # ------------------------------------------------------------- placement
    def _buffers(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, projection)
        if key not in self._a:
            shape = self.targets[layer][projection]
            width = shape.num_parts * self.max_rank
            self._a[key] = torch.zeros(self.num_slots, width, shape.in_features, device=self.device)
            self._b[key] = torch.zeros(self.num_slots, shape.out_features, width, device=self.device)
        return self._a[key], self._b[key]

    def place(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (clearing what the slot held before)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            projection, part = PEFT_MODULES[module]
            shape = self.targets[layer][projection]
            sa, sb = self._buffers(layer, projection)
            p, r = shape.part_index(part), a.shape[0]
            start, rows = shape.part(part)
            col = p * self.max_rank
            sa[slot, col : col + r].copy_(a)
            sb[slot, start : start + rows, col : col + r].copy_(b)
        self.scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for key in self._a:
            self._a[key][slot].zero_()
            self._b[key][slot].zero_()
        self.scales[slot] = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self._a, self._b) for t in d.values())

    # ------------------------------------------------------------------ step
    def begin_step(self, slots: list[int]) -> None:
        """This step's slot per token (-1 = base), in the step's row order."""
        if not slots or max(slots) < 0:
            self._step = None
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._step = lora_groups(idx, self.num_slots)

    def end_step(self) -> None:
        self._step = None

    @property
    def active(self) -> bool:
        """The current step has adapter tokens."""
        return self._step is not None

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] += each adapter token's update of ``projection`` in ``layer`` (x [T, in])."""
        step = self._step
        if step is None:
            return y
        a = self._a.get((layer, projection))
        if a is None:  # no loaded adapter targets it
            return y
        return lora(y, x, a, self._b[(layer, projection)], self.scales, groups=step)
