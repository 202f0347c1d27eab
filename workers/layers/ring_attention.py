"""Ring attention for sequence-parallel prefill: a long prompt chunk's tokens are split over the sp
group's W ranks, and the K/V travel around the ring so that each rank attends its queries to the
whole causal context and ends up with the chunk's full KV in its cache.

Why a ring and not Ulysses. Ulysses re-shards by heads with two all-to-alls per layer, which needs
the kv heads to split evenly over the W ranks (SmolLM2 has 3 kv heads: no split in 2), and again
inside each tensor-parallel shard. A ring passes whole K/V blocks, so any head count works, composes
with TP (each tp rank rings only its own heads), and the K/V every rank receives is exactly what its
KV cache needs for decode. The price -- W - 1 hops of the chunk's K/V per layer -- overlaps with
the attention math over gloo/NCCL: each hop's transfer is posted before the previous block is
computed. On one host (shared memory, workers/parallel/comm.py ``ring_shift``) a hop is a copy in
and a copy out, done before the block is computed: memory speed, nothing left to hide.

Split (zigzag, for causal balance). The chunk's n tokens (positions P .. P + n - 1 after a cached
prefix of P tokens) are cut into 2W near-equal pieces 0 .. 2W-1; rank r holds pieces r and 2W-1-r,
its rows in that order. A contiguous split would give the last rank W times the first one's
attention work; the zigzag gives every rank the same. Example W = 2: rank 0 holds pieces 0 and 3,
rank 1 pieces 1 and 2; piece 3 sees 0, 1, 2 and itself, piece 0 only itself.

Math. For a local piece p, the exact attention over its visible keys is assembled from partials
(out_i, lse_i) over disjoint key sets and merged with ``kernels.merge_attn_states``:
  - local: the cached prefix + (for the second piece) the first local piece + causally itself:
    one ``varlen_paged_attention`` call over a small contiguous buffer [prefix; piece a; piece b]
    used as a one-block cache;
  - remote: for each received piece q < p, all of q's keys (no mask): ``full_attention_lse``.
Every received block is also written into this rank's KV cache at its slots, so after the ring each
rank holds the chunk's whole KV for its heads and decode proceeds replicated over the sp ranks.

Axes: n rows of this rank, m remote keys, H query heads, G kv heads, D head dim, S cache slots,
W sp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.merge_attn_states import merge_attn_states
from kernels.varlen_paged_attention import varlen_paged_attention
from workers.parallel import comm
from workers.parallel.groups import GroupCoordinator

QUERY_BLOCK = 512  # query rows per score matrix in full_attention_lse (bounds its memory)


@dataclass(frozen=True)
class RingChunk:
    """One prefill chunk split over the sp ranks, as seen by this rank (built once per step)."""

    row_start: int  # this rank's rows [row_start, row_start + sizes[a] + sizes[b]) of the step
    local: tuple[int, int]  # the two piece indices held here (r, 2W-1-r)
    sizes: tuple[int, ...]  # [2W] tokens per piece
    piece_slots: tuple[torch.Tensor, ...]  # [2W] x [size] cache slots of each piece's tokens
    prefix_slots: torch.Tensor | None  # [P] slots of the cached prefix (None if P = 0)

    @property
    def num_rows(self) -> int:
        return self.sizes[self.local[0]] + self.sizes[self.local[1]]


def zigzag_pieces(n: int, world: int) -> list[int]:
    """Sizes of the 2W pieces of n tokens (near-equal, the first n % 2W one larger)."""
    base, extra = divmod(n, 2 * world)
    return [base + (i < extra) for i in range(2 * world)]


def full_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query to every key (no mask): q [n, H, D], k, v [m, G, D] ->
    (out [n, H, D], lse [n, H] fp32). GQA without copying K/V: the H/G query heads of a kv head
    are stacked into one matrix against that head's keys."""
    n, h, d = q.shape
    g = k.shape[1]
    rep = h // g
    kg, vg = k.permute(1, 0, 2).float(), v.permute(1, 0, 2).float()  # [G, m, D]
    out = q.new_empty(n, h, d)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    for s in range(0, n, QUERY_BLOCK):
        e = min(n, s + QUERY_BLOCK)
        b = e - s
        qg = q[s:e].float().view(b, g, rep, d).permute(1, 2, 0, 3).reshape(g, rep * b, d)  # [G, rep b, D]
        scores = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)  # [G, rep b, m]
        l = torch.logsumexp(scores, dim=-1)  # [G, rep b]
        o = torch.bmm(scores.sub_(l[..., None]).exp_(), vg)  # [G, rep b, D]
        out[s:e] = o.view(g, rep, b, d).permute(2, 0, 1, 3).reshape(b, h, d)
        lse[s:e] = l.view(g, rep, b).permute(2, 0, 1).reshape(b, h)
    return out, lse


def _local_partial(q, k, v, k_cache, v_cache, rc: RingChunk, scale: float):
    """Partials of both local pieces over [prefix; piece a; piece b] (causal within the chunk)."""
    na, nb = rc.sizes[rc.local[0]], rc.sizes[rc.local[1]]
    ks, vs = [k], [v]
    if rc.prefix_slots is not None:
        ks.insert(0, k_cache[rc.prefix_slots].to(k.dtype))  # the cache may be bf16 under fp32 activations
        vs.insert(0, v_cache[rc.prefix_slots].to(v.dtype))
    kt, vt = torch.cat(ks), torch.cat(vs)  # [P + na + nb, G, D]: a one-block cache
    p = kt.shape[0] - na - nb
    dev = q.device
    table = torch.zeros(2, 1, dtype=torch.int32, device=dev)
    cu = torch.tensor([0, na, na + nb], dtype=torch.int32, device=dev)
    ctx = torch.tensor([p + na, p + na + nb], dtype=torch.int32, device=dev)
    return varlen_paged_attention(q, kt, vt, table, cu, ctx, kt.shape[0], scale, return_lse=True)


def ring_attention(
    q: torch.Tensor,  # [n, H, D] this rank's rows of the chunk, rotated
    k: torch.Tensor,  # [n, G, D] rotated, already written to the cache
    v: torch.Tensor,  # [n, G, D]
    k_cache: torch.Tensor,  # [S, G, D]
    v_cache: torch.Tensor,  # [S, G, D]
    rc: RingChunk,
    sp: GroupCoordinator,
    scale: float,
) -> torch.Tensor:  # [n, H, D]
    """Exact causal attention of this rank's rows over the whole chunk (and its cached prefix);
    collective over the sp group. Also writes every other rank's K/V of the chunk into the cache."""
    w, r = sp.world_size, sp.rank
    a, b = rc.local
    na = rc.sizes[a]
    cur = torch.stack([k, v])  # [2, n, G, D]: what travels
    per_row = cur[:, :1].numel()  # elements per token row of cur
    max_numel = per_row * max(rc.sizes[i] + rc.sizes[2 * w - 1 - i] for i in range(w))
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {a: [], b: []}
    for hop in range(1, w + 1):
        owner = (r - hop + 1) % w  # whose pieces ``cur`` holds
        reqs: list[Any] = []
        incoming: torch.Tensor | None = None
        if hop < w:  # post the next transfer first, then compute on cur while it flies
            src = (r - hop) % w
            incoming = cur.new_empty(2, rc.sizes[src] + rc.sizes[2 * w - 1 - src], *cur.shape[2:])
            reqs = comm.ring_shift(cur, incoming, max_numel, sp)
        if owner == r:
            o, lse = _local_partial(q, k, v, k_cache, v_cache, rc, scale)
            parts[a].append((o[:na], lse[:na]))
            parts[b].append((o[na:], lse[na:]))
        else:
            _attend_remote(q, cur, owner, rc, w, scale, parts, k_cache, v_cache)
        for req in reqs:
            req.wait()
        if incoming is not None:  # None after the last hop, where cur is not read again
            cur = incoming
    out = torch.empty_like(q)
    for piece, rows in ((a, slice(0, na)), (b, slice(na, None))):
        os_, ls = zip(*parts[piece])
        out[rows] = os_[0] if len(os_) == 1 else merge_attn_states(list(os_), list(ls))[0]
    return out


def _attend_remote(q, kv, owner: int, rc: RingChunk, w: int, scale: float, parts, k_cache, v_cache) -> None:
    """Cache the owner's two pieces and add each local piece's partial over the visible ones."""
    pieces = (owner, 2 * w - 1 - owner)
    n0 = rc.sizes[pieces[0]]
    spans = {pieces[0]: slice(0, n0), pieces[1]: slice(n0, None)}
    for p in pieces:
        k_cache[rc.piece_slots[p]] = kv[0, spans[p]].to(k_cache.dtype)
        v_cache[rc.piece_slots[p]] = kv[1, spans[p]].to(v_cache.dtype)
    a, b = rc.local
    na = rc.sizes[a]
    for local, rows in ((a, slice(0, na)), (b, slice(na, rc.num_rows))):
        visible = [p for p in pieces if p < local and rc.sizes[p] > 0]
        if not visible or rc.sizes[local] == 0:
            continue
        ks = torch.cat([kv[0, spans[p]] for p in visible])  # [m, G, D]
        vs = torch.cat([kv[1, spans[p]] for p in visible])
        parts[local].append(full_attention_lse(q[rows], ks, vs, scale))
