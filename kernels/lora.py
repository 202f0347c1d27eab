"""Batched LoRA: add each token's own adapter's low-rank update to a linear layer's output.

Every token t of a step has an adapter slot idx[t] (-1 = the base model, no update). Slot s holds
adapter s's down-projection A[s] [R, K] and up-projection B[s] [N, R] and its scale scales[s]
(PEFT's lora_alpha / r, or lora_alpha / sqrt(r) with rslora):

    y[t] += scales[idx[t]] * (x[t] @ A[idx[t]]^T) @ B[idx[t]]^T          for every t with idx[t] >= 0

so one pass serves a batch that mixes adapters and the base model on shared base weights (the
"punica" / S-LoRA scheme). An adapter of rank r < R is zero-padded to R (its padded rows of A and
columns of B are 0 and add exactly 0).

Worked example (K = N = 1, R = 1): x = [[1], [2], [3]], idx = [0, -1, 1], A = [[[2]], [[3]]],
B = [[[10]], [[1]]], scales = [0.5, 1], y = 0 -> y = [[10], [0], [9]] (token 1 runs the base model).

Grouping: ``lora_groups(idx, S)`` sorts the adapter tokens by slot once per step (every layer of the
step reuses it): ``rows`` [M] the tokens with an adapter, slot by slot, and ``offsets`` [S + 1]
(slot s owns rows[offsets[s]:offsets[s + 1]]). The update is then two grouped GEMMs over those
rows (kernels/grouped_gemm.py: slots with no tokens cost nothing, base tokens are never touched)
with the scale applied to the rank-R intermediate:

    h = grouped_gemm(x[rows], A, offsets) * scales[slot of row]     # [M, R]
    y.index_add_(0, rows, grouped_gemm(h, B, offsets))              # [M, N] added to y's rows

Decode-sized steps (at most DENSE_MAX_TOKENS tokens) take the dense form instead: every token is
multiplied by the A of every slot up to the highest slot the step uses (U slots), the rank-R
blocks of other slots are zeroed by a per-token mask that also carries the scale (0 for base
tokens), and one product with all those slots' B adds the update to every row of y:

    h = (x @ A[:U].view(U R, K)^T) * mask            # [T, U R]; mask[t, s R + r] = scales[s] [s = idx[t]]
    y += h @ B[:U]^T.view(U R, N)                     # [T, N]

Two GEMMs per call however many slots the step mixes, each slot's weights read once and never
copied, no sort and no scatter (base rows get an exact 0 added). The products do U times the
useful multiply-adds, which at decode sizes is far below the base layer's own (T U R (K + N) vs
T K N). Larger steps (prefill) keep the grouped form, which does only the useful work.

``b`` is read as its transpose: a ``b`` that is the transposed view of a contiguous [S, R, N]
buffer (workers/lora/stacks.py stores B so) makes ``B[:U]^T.view(U R, N)`` a view, not a copy.

Precision: the slots' weights are float32, or bfloat16 for a bf16 model (half the bytes a step
reads: at decode sizes the update is bound by reading every used slot's A and B). The dense form
computes in the slots' dtype (bf16 products accumulate in fp32 inside oneDNN, h and the update are
rounded to bf16, as the base layer's own output is); the grouped form and the reference compute in
float32 and round the update once when adding it to y.

Per projection (``lora_parts``, what the model's layers call): a fused projection (q/k/v, gate/up)
gets every targeted part's update in one call. On CPU, with x, y and the slots all float32 or all
bfloat16 and at most ROWS_MAX_TOKEN_RANKS tokens x rank, that is one C++ call
(kernels/csrc/lora.cpp) that goes token by token: h = scale * A_p[s] x[t] (R dot products), then y's
part columns += h Bt_p[s] (R axpys over the transposed B's contiguous rows), fp32 accumulation, y
rounded once. No intermediate tensors, no mask, no per-part Python; each token's update depends on
that token alone, so a row gives the same bits in any batch. Its cost grows with tokens x rank
(every token reads its slot's A and B, cache-resident after the first token of a slot), so long
prompts at high rank take the grouped GEMMs, which do the same multiply-adds blocked through MKL.
Otherwise (another dtype mix, CUDA, the kernels off) it is one ``lora`` call per part.

Dispatch of ``lora``: CPU -> the two grouped GEMMs above through the C++ grouped GEMM kernel (GEMV below
GEMV_MAX_ROWS rows per slot, MKL above; ``grouped_gemm`` counts a fallback to its torch reference
where the extension is missing). CUDA with triton -> one fused Triton kernel gathered per token
(kernels/triton_ops/lora.py: no sort, no intermediate buffer); CUDA without triton -> the grouped
path over ``grouped_gemm``'s reference, counted as a fallback. ``lora_ref`` is the plain per-slot
loop the tests compare with.

Axes: T tokens in the step, M tokens with an adapter, K input features, N output features,
R the slots' rank, S adapter slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _build, _triton
from kernels.grouped_gemm import grouped_gemm

_F32 = torch.float32

# Steps with at most this many tokens use the dense form or the per-token kernel (docstring).
DENSE_MAX_TOKENS = 32
_ROWS_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ per-token kernel takes (x, y and slots alike)
# lora_parts takes the per-token kernel up to this many tokens x rank, the grouped GEMMs above (docstring).
ROWS_MAX_TOKEN_RANKS = 1 << 16


@dataclass(frozen=True)
class LoraGroups:
    """A step's adapter tokens grouped by slot (see the module docstring)."""

    rows: torch.Tensor  # [M] int64: the tokens with an adapter, sorted by slot (stable)
    offsets: torch.Tensor  # [S + 1] int64: slot s owns rows[offsets[s]:offsets[s + 1]]
    row_slots: torch.Tensor  # [M] int64: the slot of each of rows
    idx: torch.Tensor  # [T] int64: every token's slot (-1 = base), what the Triton kernel reads
    onehot: torch.Tensor  # [T, U] float32: onehot[t, s] = 1 where idx[t] = s (dense form)

    @property
    def num_used(self) -> int:
        """U: one more than the highest slot a token uses (slots above it are not read)."""
        return self.onehot.shape[1]

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0


def lora_groups(idx: torch.Tensor, num_slots: int) -> LoraGroups:
    # idx [T] int (-1 = base) -> LoraGroups over num_slots slots
    idx = idx.to(torch.long)
    if idx.numel() and int(idx.max()) >= num_slots:
        raise ValueError(f"lora: adapter index {int(idx.max())} >= {num_slots} slots")
    rows = torch.nonzero(idx >= 0).view(-1)
    row_slots, order = torch.sort(idx.index_select(0, rows), stable=True)
    rows = rows.index_select(0, order)
    counts = torch.bincount(row_slots, minlength=num_slots)
    offsets = torch.zeros(num_slots + 1, dtype=torch.long, device=idx.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    used = int(row_slots[-1]) + 1 if row_slots.numel() else 0
    onehot = torch.zeros(idx.shape[0], used, dtype=_F32, device=idx.device)
    if rows.numel():
        onehot[rows, row_slots] = 1.0
    return LoraGroups(rows, offsets, row_slots, idx, onehot)


def lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             idx: torch.Tensor) -> torch.Tensor:
    # y [T, N] (updated in place and returned), x [T, K], a [S, R, K], b [S, N, R], scales [S], idx [T]
    for s in range(a.shape[0]):
        sel = torch.nonzero(idx == s).view(-1)
        if sel.numel():
            xs = x.index_select(0, sel).to(_F32)
            delta = (xs @ a[s].to(_F32).T) @ b[s].to(_F32).T * scales[s].to(_F32)  # [m, N]
            y.index_add_(0, sel, delta.to(y.dtype))
    return y


def _check(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"lora: y [T, N], x [T, K], a [S, R, K], b [S, N, R]; got {tuple(y.shape)}, "
                         f"{tuple(x.shape)}, {tuple(a.shape)}, {tuple(b.shape)}")
    t, k = x.shape
    s, r, _ = a.shape
    n = y.shape[1]
    if y.shape[0] != t or a.shape[2] != k or b.shape != (s, n, r) or scales.shape != (s,):
        raise ValueError(f"lora: shapes disagree: y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, scales {tuple(scales.shape)}")


def lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
         idx: torch.Tensor | None = None, groups: LoraGroups | None = None) -> torch.Tensor:
    # y [T, N] += per-token LoRA update (in place, returned); x [T, K]; a [S, R, K] and b [S, N, R]
    # float32 or bfloat16, scales [S] float32; either idx [T] or the step's groups (lora_groups(idx, S))
    _check(y, x, a, b, scales)
    if groups is None:
        assert idx is not None, "lora: pass idx or groups"
        groups = lora_groups(idx, a.shape[0])
    if groups.empty:
        return y
    if x.is_cuda:
        if _triton.triton_available():
            return _triton.ops("lora").lora_triton(y, x, a, b, scales, groups.idx)
        _build.note_fallback("lora", "triton unavailable")
    if x.shape[0] <= DENSE_MAX_TOKENS:
        return _dense(y, x, a, b, scales, groups)
    xs = x.index_select(0, groups.rows)
    if xs.dtype is not _F32:
        xs = xs.to(_F32)
    h = grouped_gemm(xs, a.to(_F32), groups.offsets)  # [M, R] (bf16 slots widened: the C++ kernel is fp32)
    h.mul_(scales.index_select(0, groups.row_slots).unsqueeze(1))
    delta = grouped_gemm(h, b.to(_F32).contiguous(), groups.offsets)  # [M, N]
    y.index_add_(0, groups.rows, delta if y.dtype is _F32 else delta.to(y.dtype))
    return y


def lora_parts(y: torch.Tensor, x: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, int]],
               scales: torch.Tensor, groups: LoraGroups) -> torch.Tensor:
    # y [T, N] += every part's per-token update into its columns (in place, returned); x [T, K];
    # parts: (a [S, R, K], bt [S, R, n] (B transposed, last dim contiguous), first column of y)
    if groups.empty or not parts:
        return y
    if (x.is_cpu and x.shape[0] * parts[0][0].shape[1] <= ROWS_MAX_TOKEN_RANKS and x.dtype in _ROWS_DTYPES and y.dtype is x.dtype
            and parts[0][0].dtype is x.dtype):
        ext = _build.ext()
        if ext is not None:
            xc = x if x.stride(1) == 1 else x.contiguous()
            ext.lora_rows(y, xc, [a for a, _, _ in parts], [bt for _, bt, _ in parts],
                          [start for _, _, start in parts], scales, groups.idx)
            return y
        _build.note_ref_path("lora")
    for a, bt, start in parts:
        lora(y.narrow(1, start, bt.shape[2]), x, a, bt.transpose(1, 2), scales, groups=groups)
    return y


def _dense(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
           groups: LoraGroups) -> torch.Tensor:
    """The dense form of the module docstring (every token, the first U slots)."""
    u, r, k = groups.num_used, a.shape[1], a.shape[2]
    n = b.shape[1]
    xf = x if x.dtype is a.dtype else x.to(a.dtype)
    mask = (groups.onehot * scales[:u]).unsqueeze(2).to(a.dtype)  # [T, U, 1]
    h = (xf @ a[:u].reshape(u * r, k).T).view(-1, u, r).mul_(mask)  # [T, U, R]
    bt = b[:u].transpose(1, 2).reshape(u * r, n)  # [U R, N]: a view when b is a transposed [S, R, N]
    delta = h.view(-1, u * r) @ bt  # [T, N]
    return y.add_(delta)


__all__ = ["LoraGroups", "lora", "lora_groups", "lora_parts", "lora_ref"]
