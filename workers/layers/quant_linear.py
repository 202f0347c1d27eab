"""Weight-only quantized linear layers that own their weight loading, like layers/linear.py.

Terms:
    quantization  the per-model choice, ``EngineConfig.quantization``: 'none' (fp weights),
                  'int8' (per-output-channel scales, fp32 activations: kernels/int8_linear.py) or
                  'q4' (4-bit blocks of 32 with an fp16 scale and min, GGUF Q4_1's math, int8
                  activations: kernels/quant_linear.py). Formats: kernels/quant_formats.py.
    QuantizedWeight  a checkpoint tensor that arrives already quantized (a GGUF Q4_0/Q4_1 tensor
                  repacked into our q4 layout): loaded as is, never through fp32.

A layer's ``load_weight(loaded, shard_id)`` takes either a float tensor (quantized here, row by
row, so fused q/k/v and gate/up shards quantize independently) or a QuantizedWeight (copied as is
if it has the layer's method, else de-quantized and re-quantized). Shards for tensor parallelism
(the layers in workers/layers/quant_parallel.py): ``QuantizedWeight.rows`` (column-parallel: a
slice of output rows) and ``.cols`` (row-parallel: a slice of input features on 32-column block
boundaries, so blocks stay whole).

Example::

    layer = QuantLinear(576, 960, method="q4")
    layer.load_weight(torch.randn(960, 576))   # quantized at load time
    y = layer(torch.randn(1, 576))             # [1, 960] through the C++ q4 kernel
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.quant_formats import (
    BLOCK,
    dequantize_int8,
    dequantize_q4,
    pack_q4,
    padded_k,
    quantize_int8,
    quantize_q4,
    unpack_q4,
)
from kernels.int8_linear import int8_linear, int8_tiles
from kernels.linear import packed_linear, prepack
from kernels.quant_linear import q4_linear, q4_tiles, quant_tiles_used
from workers.config import QUANTIZATIONS
from workers.layers.linear import Linear

_BUFFERS = {"int8": ("qweight", "scales"), "q4": ("qweight", "scales", "mins")}
# A step with more prompt rows than this runs them on the layer's bf16 copy when it has one
# (``make_bf16_copy``): oneDNN's bf16 GEMM on AMX does ~3x the work per second of the int8 dot there
# (benchmarks/README.md). Decode rows (StepRows) and smaller batches take the quantized kernel,
# whose int8 dot products are batch-invariant and stream 4x (q4) fewer weight bytes.
BF16_COPY_MIN_ROWS = 64


class StepRows:
    """How many of the current step's rows lead as decode rows (plain decodes and speculative verify
    rows: the model runner puts them first and sets ``decode`` before each forward pass). Shared by a
    model's quantized layers that keep a bf16 copy: a step that also carries a long prompt chunk runs
    only the prompt rows on the copy and its decode rows on the quantized kernel, so a decode row's
    numbers never depend on what else the step carries (greedy output does not change with load,
    and speculative verification stays exact)."""

    __slots__ = ("decode",)

    def __init__(self) -> None:
        self.decode = 0


@dataclass(frozen=True)
class QuantizedWeight:
    """An already-quantized [N, K] weight in one of our formats; ``tensors`` maps buffer name ->
    tensor (int8: qweight [N, Kp], scales [N]; q4: qweight [N, Kp / 2], scales, mins [N, Kp / 32])."""

    method: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]

    def rows(self, start: int, size: int) -> QuantizedWeight:
        """Output rows [start, start + size): a column-parallel shard or a fused projection."""
        return QuantizedWeight(self.method, (size, self.shape[1]), {k: v.narrow(0, start, size) for k, v in self.tensors.items()})

    def cols(self, start: int, size: int) -> QuantizedWeight:
        """Input features [start, start + size) of every row: a row-parallel shard. It must be whole
        32-weight blocks (start a multiple of 32, and size too unless the slice runs to K), so q4
        blocks stay whole; the codes are re-packed into whole 64-column chunks, exactly the layout
        ``quantize`` gives the same columns. int8 keeps its per-row scales (the full row's)."""
        K = self.shape[1]
        if start % BLOCK or (size % BLOCK and start + size != K) or start + size > K:
            raise ValueError(f"quantized column shard [{start}, {start + size}) of K={K} must start on a multiple "
                             f"of {BLOCK} and span whole {BLOCK}-column blocks (or end at K)")
        t, pad = self.tensors, padded_k(size) - size
        if self.method == "int8":
            out = {"qweight": F.pad(t["qweight"][:, start : start + size], (0, pad)), "scales": t["scales"]}
        else:
            codes = unpack_q4(t["qweight"].contiguous())[:, start : start + size]  # [N, size]
            first, n = start // BLOCK, -(-size // BLOCK)  # this slice's blocks
            out = {"qweight": pack_q4(F.pad(codes, (0, pad)))}
            out |= {k: F.pad(t[k][:, first : first + n], (0, padded_k(size) // BLOCK - n)) for k in ("scales", "mins")}
        return QuantizedWeight(self.method, (self.shape[0], size), out)

    def dequantize(self) -> torch.Tensor:
        t, K = self.tensors, self.shape[1]
        if self.method == "int8":
            return dequantize_int8(t["qweight"], t["scales"], K)
        return dequantize_q4(t["qweight"], t["scales"], t["mins"], K)


def quantize(method: str, w: torch.Tensor) -> QuantizedWeight:
    """Quantize a float [N, K] weight with ``method`` ('int8' | 'q4')."""
    if method == "int8":
        tensors = dict(zip(_BUFFERS["int8"], quantize_int8(w)))
    elif method == "q4":
        tensors = dict(zip(_BUFFERS["q4"], quantize_q4(w)))
    else:
        raise ValueError(f"quantization {method!r}: must be one of {QUANTIZATIONS[1:]}")
    return QuantizedWeight(method, (w.shape[0], w.shape[1]), tensors)


class QuantLinear(nn.Module):
    """y = x dequant(W)^T (+ b), W [out, in] stored quantized (buffers), bias fp32."""

    qweight: torch.Tensor  # buffers (registered in __init__; mins for q4 only)
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: str = "int8") -> None:
        super().__init__()
        if method not in _BUFFERS:
            raise ValueError(f"quantization {method!r}: must be one of {QUANTIZATIONS[1:]}")
        self.in_features, self.out_features, self.method = in_features, out_features, method
        self._int8 = method == "int8"
        N, Kp = out_features, padded_k(in_features)
        if method == "int8":
            self.register_buffer("qweight", torch.zeros(N, Kp, dtype=torch.int8))
            self.register_buffer("scales", torch.zeros(N, dtype=torch.float32))
        else:
            self.register_buffer("qweight", torch.zeros(N, Kp // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.zeros(N, Kp // 32, dtype=torch.int16))
            self.register_buffer("mins", torch.zeros(N, Kp // 32, dtype=torch.int16))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]  # read back by load_weights
        else:
            self.register_parameter("bias", None)
        # the de-quantized weight in bf16, oneDNN-packed (``make_bf16_copy``; None = none): derived
        # state, never saved or shared
        self.bf16_copy: torch.Tensor | None = None
        self.step_rows: StepRows | None = None  # with a bf16 copy: the step's leading decode rows (StepRows)
        # the weights in the VNNI kernel's tile order (``make_tiles``; None = none): derived state,
        # never saved or shared
        self.tiles: torch.Tensor | None = None

    def make_tiles(self) -> bool:
        """On a CPU whose quantized kernel takes the AVX-512 VNNI path: also keep the weights in that
        path's tile order (kernels ``int8_tiles`` / ``q4_tiles``), so that each call streams them as
        they are instead of repacking every 16-row tile first (bit-identical results; the repack
        cost batch-1 decode more than reading the weights). True if made; it costs the codes'
        memory again (int8: 8 bits per weight, q4: ~4.5). ``load_weight`` refreshes it in place
        (the fused decode stack holds it)."""
        if not quant_tiles_used():
            return False
        self.tiles = self._tiles()
        return self.tiles is not None

    def _tiles(self) -> torch.Tensor | None:
        if self._int8:
            return int8_tiles(self.qweight)
        return q4_tiles(self.qweight, self.scales, self.mins)

    def make_bf16_copy(self, step_rows: StepRows | None = None) -> bool:
        """Keep the de-quantized weight as a oneDNN-packed bf16 copy (kernels/linear.py ``prepack``) for
        batches of more than BF16_COPY_MIN_ROWS rows; True if made (CPU with oneDNN only). The copy
        holds this layer's quantized values (each rounded to bf16: 8 significant bits, far finer
        than the 4- or 8-bit grid they sit on); it costs 2 bytes per weight of memory. step_rows: the
        model's StepRows (its decode rows stay on the quantized kernel)."""
        if not self.qweight.is_cpu:
            return False
        self.step_rows = step_rows
        w = self.quantized_weight().dequantize()  # [N, K] fp32
        self.bf16_copy = prepack(w.to(torch.bfloat16))
        return self.bf16_copy is not None

    # Shards: None = the whole layer (MergedLinear's subclass maps its shard ids).
    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        return 0, self.out_features

    def shard_ids(self) -> tuple[str | None, ...]:
        return (None,)

    def load_weight(self, loaded: torch.Tensor | QuantizedWeight, shard_id: str | None = None) -> None:
        """Fill this layer's rows for ``shard_id`` from a float [rows, in] tensor or a QuantizedWeight."""
        start, size = self._rows(shard_id)
        shape = tuple(loaded.shape)
        if shape != (size, self.in_features):
            raise ValueError(f"{shard_id or 'weight'}: got a {list(shape)} weight for a layer expecting "
                             f"[{size}, {self.in_features}]")
        if isinstance(loaded, QuantizedWeight) and loaded.method != self.method:
            loaded = loaded.dequantize()  # e.g. a GGUF's 4-bit output matrix for our int8 LM head
        q = loaded if isinstance(loaded, QuantizedWeight) else quantize(self.method, loaded)
        for name in _BUFFERS[self.method]:
            getattr(self, name).narrow(0, start, size).copy_(q.tensors[name])
        self.bf16_copy = None  # the weight changed: a copy made before is stale
        if self.tiles is not None:  # in place: whoever holds the tiles sees the new weights
            self.tiles.copy_(self._tiles())  # type: ignore[arg-type]  # made before, so the kernels are there

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Loader of the fp bias (same contract as Linear.weight_loader)."""
        start, size = self._rows(shard_id)
        dst = param.data.narrow(0, start, size)
        assert dst.shape == loaded.shape, (shard_id, dst.shape, loaded.shape)
        dst.copy_(loaded)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.method, (self.out_features, self.in_features),
                               {n: getattr(self, n) for n in _BUFFERS[self.method]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]. Reads _buffers / _parameters directly: nn.Module.__getattr__ is a
        # slow Python fallback, and a decode step would make hundreds of those lookups.
        bias = self._parameters["bias"]
        copy = self.bf16_copy
        if copy is not None and x.numel() > BF16_COPY_MIN_ROWS * x.shape[-1]:
            rows = self.step_rows
            # every decode row, also in a decode-only step of more than BF16_COPY_MIN_ROWS rows: a
            # decode row's numbers must not depend on whether a prompt chunk shares its step
            n = min(rows.decode, x.shape[0]) if rows is not None and x.dim() == 2 else 0
            if x.shape[0] - n > BF16_COPY_MIN_ROWS:  # the prompt rows on the copy, decode rows on the kernel
                y = packed_linear(x[n:].to(torch.bfloat16), copy, self.out_features).float()
                if bias is not None:
                    y.add_(bias)
                return y if n == 0 else torch.cat([self._kernel(x[:n], bias), y])
        return self._kernel(x, bias)

    def _kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b: dict[str, Any] = self._buffers  # all registered in __init__
        if self._int8:
            return int8_linear(x, b["qweight"], b["scales"], bias, self.tiles)
        return q4_linear(x, b["qweight"], b["scales"], b["mins"], bias, self.tiles)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.method}, bias={self.bias is not None}"


class QuantMergedLinear(QuantLinear):
    """Several projections of one input stacked along the output dim (q/k/v, gate/up), quantized.

    ``shards`` maps shard id -> output size, in order (as MergedLinear). Rows quantize
    independently, so loading a shard never touches another's codes or scales.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False, method: str = "int8") -> None:
        super().__init__(in_features, sum(shards.values()), bias, method)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.offsets[name] = (start, size)
            start += size

    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        assert shard_id in self.offsets, f"unknown shard {shard_id!r}"
        return self.offsets[shard_id]

    def shard_ids(self) -> tuple[str | None, ...]:
        return tuple(self.offsets)


def make_linear(in_features: int, out_features: int, bias: bool, quantization: str) -> nn.Module:
    """Linear for 'none', else QuantLinear with that method (a single-rank layer, e.g. a drafter's head)."""
    if quantization == "none":
        return Linear(in_features, out_features, bias)
    return QuantLinear(in_features, out_features, bias, quantization)
