"""Tensor-parallel quantized layers: the int8 / q4 counterparts of layers/linear.py's column- and
row-parallel linears and of vocab_parallel.py's LM head, with the same shards (decided in
workers/parallel/sharding.py) and the same collectives.

Each rank quantizes only its shard of a float checkpoint tensor, or slices a QuantizedWeight (a
GGUF's 4-bit tensor) without a trip through fp32, and a TP gang computes what one rank computes:
the same codes, the same scales, the same activation blocks; only the float summation order of the
all-reduce differs. That holds because:
  - column-parallel shards (fused q/k/v with GQA, fused gate/up, the LM head's vocabulary rows) are
    whole output rows, and both formats quantize each row on its own (int8 one scale per row, q4
    blocks along the row), so a rank's rows are exactly the single rank's rows;
  - row-parallel shards (o_proj, down_proj) are a range of input features of every row:
      int8: a row's scale is max |w| / 127 over the FULL row, taken from the whole checkpoint row
            (a shard quantized on its own would take its own max and get other scales and codes);
      q4, and the kernels' per-token activation quantization: both work in blocks of 32 along the
            input features, so a shard must start on a block boundary and be whole blocks (or run
            to the end of the row); then its blocks are the single rank's blocks. Other splits are
            refused with a ConfigError naming the sizes.
    Example: SmolLM2's o_proj (in = 9 heads x 64) at TP=2 splits at 384 (6 heads | 3 heads, GQA
    groups whole), down_proj (in = 1536) at 768; Qwen2.5-0.5B splits at 448 and 2432, -1.5B at
    768 and 4480: all on block boundaries. A bias is held by tp rank 0 only (zeros on the other
    ranks), so each rank's kernel adds its bias to its partial sum and the all-reduce adds it once.
  - the LM head (int8, see workers/models/llama.py) holds ceil(V / W) vocabulary rows per rank
    (padding rows zero) and gathers the sampled rows' logits to tp rank 0, like ParallelLMHead.

Axes: T tokens, N sampled rows, E hidden, K input features, V vocabulary, W tp ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.quant_formats import BLOCK, quantize_int8
from workers.errors import ConfigError
from workers.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.quant_linear import QuantizedWeight, QuantLinear, QuantMergedLinear, quantize
from workers.layers.vocab_parallel import VocabParallelEmbedding, gather_vocab_logits
from workers.parallel import comm
from workers.parallel.groups import GroupCoordinator, get_group
from workers.parallel.sharding import Shard, even_shard, take, vocab_shard

Loaded = torch.Tensor | QuantizedWeight


def take_rows(loaded: Loaded, shard: Shard) -> Loaded:
    """Output rows ``shard`` of a float or quantized checkpoint tensor (a view where possible)."""
    if isinstance(loaded, QuantizedWeight):
        return loaded.rows(shard.start, shard.size)
    return take(loaded, 0, shard)


def quantize_cols(method: str, w: torch.Tensor, shard: Shard) -> QuantizedWeight:
    """Quantize input features ``shard`` of a float [N, K] weight exactly as ``quantize(method, w)``
    would quantize them: int8 with the full rows' scales, q4 blocks local (shard on block bounds)."""
    part = take(w, 1, shard)  # [N, shard.size]
    if method != "int8":
        return quantize(method, part)
    qweight, scales = quantize_int8(part, amax=w.detach().float().abs().amax(dim=1))
    return QuantizedWeight("int8", (part.shape[0], part.shape[1]), {"qweight": qweight, "scales": scales})


class QuantMergedColumnParallelLinear(QuantMergedLinear):
    """Fused projections of one input, each sharded by output rows (MergedColumnParallelLinear,
    quantized): ``parts`` maps shard id -> this rank's rows of that checkpoint matrix, in order.
    Example (SmolLM2, TP=2, rank 1): {'q': Shard(384, 192), 'k': Shard(128, 64), 'v': Shard(128, 64)}."""

    def __init__(self, in_features: int, parts: dict[str, Shard], bias: bool = False, method: str = "int8") -> None:
        super().__init__(in_features, {k: s.size for k, s in parts.items()}, bias, method)
        self.parts = dict(parts)

    def load_weight(self, loaded: Loaded, shard_id: str | None = None) -> None:
        """``loaded``: the whole checkpoint matrix of ``shard_id`` ([rows, in]); keeps this rank's rows."""
        assert shard_id is not None  # a merged layer's loads name their shard
        super().load_weight(take_rows(loaded, self.parts[shard_id]), shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id is not None  # a merged layer's loads name their shard
        super().weight_loader(param, take(loaded, 0, self.parts[shard_id]), shard_id)


class QuantRowParallelLinear(QuantLinear):
    """y = all_reduce(x_r W_r^T (+ b on rank 0)): rank r holds input features ``shard`` of W,
    quantized as in the full matrix (module docstring), and gets x's matching columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: str = "int8",
                 tp: GroupCoordinator | None = None, shard: Shard | None = None) -> None:
        tp = tp or get_group("tp")
        shard = shard or even_shard(in_features, tp.world_size, tp.rank)
        check_row_shard(method, in_features, out_features, shard, tp.world_size, tp.rank)
        super().__init__(shard.size, out_features, bias, method)
        self.tp, self.shard, self.full_in_features = tp, shard, in_features

    def load_weight(self, loaded: Loaded, shard_id: str | None = None) -> None:
        """``loaded``: the whole checkpoint matrix [out, in]; keeps this rank's input features."""
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        if tuple(loaded.shape) != (self.out_features, self.full_in_features):
            raise ValueError(f"got a {list(loaded.shape)} weight for a row-parallel layer expecting "
                             f"[{self.out_features}, {self.full_in_features}]")
        if isinstance(loaded, QuantizedWeight) and loaded.method == self.method:
            part = loaded.cols(self.shard.start, self.shard.size)  # int8: the full rows' scales come along
        else:  # a float tensor, or another method's weight (de-quantized whole, for int8's full-row scales)
            w = loaded.dequantize() if isinstance(loaded, QuantizedWeight) else loaded
            part = quantize_cols(self.method, w, self.shard)
        super().load_weight(part)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """The bias: kept by tp rank 0, zeros elsewhere (the all-reduce then adds it once)."""
        super().weight_loader(param, loaded if self.tp.rank == 0 else torch.zeros_like(loaded), shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K / W] -> [T, out], the same on every rank
        y = super().forward(x)  # this rank's partial sum (+ b on rank 0)
        return comm.all_reduce(y, self.tp)  # identity when W = 1


class QuantParallelLMHead(QuantLinear):
    """logits = hidden W^T over the vocabulary with W int8: rank r holds the rows of its vocabulary
    slice (ceil(V / W) rows, the tail zero padding). Untied: loads ``lm_head.weight``; tied: a
    quantized copy of the embedding's rows (``load_tied``, after loading)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupCoordinator | None = None) -> None:
        tp = tp or get_group("tp")
        super().__init__(hidden_size, -(-vocab_size // tp.world_size), False, "int8")
        self.tp, self.vocab_size = tp, vocab_size
        self.shard = vocab_shard(vocab_size, tp.world_size, tp.rank)

    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        return 0, self.shard.size  # padding rows stay zero (scale 0: logit 0, cut off after the gather)

    def load_weight(self, loaded: Loaded, shard_id: str | None = None) -> None:
        """``loaded``: the whole [V, E] head; keeps this rank's vocabulary rows."""
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"got a {list(loaded.shape)} LM head for a vocabulary of {self.vocab_size}")
        super().load_weight(take_rows(loaded, self.shard), shard_id)

    def load_tied(self, embedding: VocabParallelEmbedding) -> None:
        """Quantize the embedding's rows (the same vocabulary slice on this rank)."""
        assert embedding.shard == self.shard, (embedding.shard, self.shard)
        super().load_weight(embedding.weight.data[: self.shard.size])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]  # an LM head
        """hidden [N, E] (the sampled rows) -> logits [N, V] on tp rank 0; None on other ranks.
        Collective over the tp group: every tp rank calls it with the same rows."""
        return gather_vocab_logits(super().forward(hidden), self.tp, self.vocab_size)  # [N, V / W] -> [N, V]


def check_row_shard(method: str, in_features: int, out_features: int, shard: Shard, tp_size: int, rank: int) -> None:
    """ConfigError unless tp rank ``rank``'s input features ``shard`` of a quantized row-parallel
    layer [out_features x in_features] fall on the BLOCK-feature blocks (module docstring)."""
    if shard.start % BLOCK or (shard.size % BLOCK and shard.end != in_features):
        raise ConfigError(
            f"quantization={method!r} with tp_size={tp_size}: the row-parallel layer "
            f"[{out_features} x {in_features}] would give tp rank {rank} input features "
            f"[{shard.start}, {shard.end}), which do not fall on the {BLOCK}-feature blocks that quantized "
            f"weights and activations use; use a tp_size that splits {in_features} on multiples of {BLOCK}, "
            "or quantization 'none'")


def column_parallel(in_features: int, parts: dict[str, Shard], bias: bool, quantization: str) -> nn.Module:
    """Fused column-parallel projection: float for 'none', else quantized with that method."""
    if quantization == "none":
        return MergedColumnParallelLinear(in_features, parts, bias)
    return QuantMergedColumnParallelLinear(in_features, parts, bias, quantization)


def row_parallel(in_features: int, out_features: int, bias: bool, quantization: str, shard: Shard) -> nn.Module:
    """Row-parallel projection over the tp group holding input features ``shard``."""
    tp = get_group("tp")
    if quantization == "none":
        return RowParallelLinear(in_features, out_features, bias, tp, shard=shard)
    return QuantRowParallelLinear(in_features, out_features, bias, quantization, tp, shard=shard)
