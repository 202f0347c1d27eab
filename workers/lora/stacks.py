"""LoraStacks: every adapter slot's weights, stacked per layer and module for kernels/lora.py.

For each (layer, PEFT module) that a loaded adapter targets (workers/lora/targets.py) the stacks hold

    a [S, R, in]     slot s's lora_A in rows [0, r) (zero below a rank r < R)
    bt [S, R, rows]  slot s's lora_B transposed, in rows [0, r); rows: the module's part of its
                     projection (kernels/lora.py reads B as ``bt.transpose(1, 2)``: its dense form
                     then multiplies by every used slot's B without a copy)

and ``scales[s]`` = slot s's lora_alpha / r (or / sqrt(r) with rslora). A module's update goes
into its part of the fused projection's output (q, k, v of qkv_proj; gate, up of gate_up_proj):
``apply`` runs the batched LoRA once per projection for all its targeted parts, each into its
column range of y (kernels/lora.py ``lora_parts``). Parts no loaded
adapter targets have no buffers and cost nothing (PEFT's default q_proj + v_proj touches two parts
of qkv and nothing else); a slot whose adapter skips a part has zeros there, which add exactly 0.

Buffers are on the model's device, in bfloat16 for a bf16 model and float32 otherwise (fp16 and
quantized models included: quantized layers take fp32 activations), allocated when the first
adapter targeting the module is placed. Cost: per slot and module R (in + rows) floats, e.g. SmolLM2-135M at R = 16 with all
seven modules targeted: 2.6M floats (10 MB) per slot over its 30 layers.

Per step the runner calls ``begin_step(slots)`` with each token's slot (-1 = base): the grouping
(kernels/lora.py ``lora_groups``) is computed once and every module of every layer reuses it; a
step without adapter tokens sets none, and ``apply`` then costs one attribute check.

Axes: S slots, R max rank, T tokens in the step.
"""

from __future__ import annotations

import torch

from kernels.lora import LoraGroups, lora_groups, lora_parts
from workers.lora.reader import LoraAdapter
from workers.lora.targets import PEFT_MODULES, LoraTargets


class LoraStacks:
    def __init__(self, targets: LoraTargets, num_slots: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> None:
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.dtype = dtype
        self.targets = targets
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=self.device)  # [S]
        self._a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, PEFT module) -> [S, R, in]
        self._b: dict[tuple[int, str], torch.Tensor] = {}  # (layer, PEFT module) -> B^T [S, R, rows]
        # (layer, projection) -> its targeted parts: (first output row, rows, module), in output order
        self._parts: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
        self._step: LoraGroups | None = None

    # ------------------------------------------------------------- placement
    def _buffers(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, module)
        if key not in self._a:
            projection, part = PEFT_MODULES[module]
            shape = self.targets[layer][projection]
            start, rows = shape.part(part)
            a = torch.zeros(self.num_slots, self.max_rank, shape.in_features, device=self.device, dtype=self.dtype)
            b = torch.zeros(self.num_slots, self.max_rank, rows, device=self.device, dtype=self.dtype)
            self._a[key], self._b[key] = a, b
            # published last, as a new list: a step on the engine thread reads whole lists only
            self._parts[(layer, projection)] = sorted([*self._parts.get((layer, projection), []),
                                                       (start, rows, module)])
        return self._a[key], self._b[key]

    def place(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` (clearing what the slot held before)."""
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            sa, sb = self._buffers(layer, module)
            r = a.shape[0]
            sa[slot, :r].copy_(a)
            sb[slot, :r].copy_(b.T)
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
        """y [T, out] += each adapter token's update of ``projection`` in ``layer`` (x [T, in]),
        part by part into the part's columns of y."""
        step = self._step
        if step is None:
            return y
        parts = self._parts.get((layer, projection))
        if not parts:
            return y
        return lora_parts(y, x, [(self._a[(layer, m)], self._b[(layer, m)], start) for start, _, m in parts],
                          self.scales, step)
