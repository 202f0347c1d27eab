"""DispatchPlan: where every token-expert assignment of a step is computed, and in which order the
rows travel, for expert parallelism over an ep group of W ranks.

Terms. An *assignment* a = t * k + j is token t's j-th routed expert (k = top-k). The step's T
tokens are split into W contiguous *slices*; rank r is the *source* of the assignments of the
tokens in its slice (it sends their hidden states out and combines their results). The
*destination* of an assignment is a rank holding its expert (ExpertPlacement); for an expert with R
replicas its n-th assignment (in token order) of c in total goes to replica floor(n R / c), an even
split. Every rank derives the same plan from the same routing (routing is computed on replicated
hidden states), so no counts are exchanged before the all-to-all.

Orders. A source sends its rows sorted by (destination, slot, a); a destination therefore receives,
from source 0, then 1, ..., rows sorted by (slot, a) within each source ("arrival order"), and
regroups them by slot ("compute order") for the grouped GEMM. Results go back in arrival order and
arrive at the source in its send order.

Worked example: T = 2, k = 2, W = 2, experts [[0, 3], [1, 0]] with experts 0-1 on rank 0 and 2-3 on
rank 1. Slices: token 0 -> rank 0, token 1 -> rank 1. Rank 0 sends a=0 (to itself) and a=1 (to rank
1): send_counts [1, 1]; rank 1 sends a=3, a=2 to rank 0 (sorted by slot: expert 0 then 1):
send_counts [2, 0]. Rank 0 receives a=0 from itself and a=3, a=2 from rank 1: recv_counts [1, 2],
compute order groups slot 0 (a=0, a=3) before slot 1 (a=2).

Axes: T tokens, k experts per token, A = T k assignments, S sent / R received assignments on this
rank, W ranks, L local slots, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchPlan:
    send_assign: torch.Tensor  # [S] assignments this rank sends, in send order
    combine_order: torch.Tensor  # [S] send-order row of each of this slice's assignments, token-major
    send_counts: list[int]  # [W] rows to each rank
    recv_counts: list[int]  # [W] rows from each rank
    compute_order: torch.Tensor | None  # [R] arrival row of each compute row; None = already grouped
    slot_offsets: torch.Tensor  # [L + 1] compute rows of slot l: [offsets[l], offsets[l + 1])
    slice_start: int  # first token of this rank's slice
    slice_counts: list[int]  # [W] tokens per slice
    rank_rows: list[int]  # [W] assignments computed by each rank (load)


def slice_bounds(num_tokens: int, world_size: int) -> list[int]:
    """[W + 1] token boundaries of the W contiguous slices (sizes differ by at most one)."""
    return [num_tokens * r // world_size for r in range(world_size + 1)]


def build_dispatch_plan(
    experts: torch.Tensor,  # [T, k] routed expert ids
    num_replicas: torch.Tensor,  # [E]
    replica_rank: torch.Tensor,  # [E, R]
    replica_slot: torch.Tensor,  # [E, R]
    num_local_slots: int,
    rank: int,
    world_size: int,
) -> DispatchPlan:
    t, k = experts.shape
    n = t * k
    dev = experts.device
    flat = experts.reshape(-1)  # [A]
    a = torch.arange(n, device=dev)  # [A]
    counts = torch.bincount(flat, minlength=num_replicas.shape[0])  # [E]
    # ordinal of each assignment among its expert's assignments, in token order
    by_expert = torch.argsort(flat, stable=True)  # [A]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    ordinal = torch.empty_like(a)
    ordinal[by_expert] = a - starts[flat[by_expert]]
    rep = ordinal * num_replicas[flat] // counts[flat]  # [A] replica index, an even split
    dest = replica_rank[flat, rep]  # [A]
    slot = replica_slot[flat, rep]  # [A]
    bounds = slice_bounds(t, world_size)
    src = torch.bucketize(a // k, torch.tensor(bounds[1:-1], device=dev), right=True)  # [A]
    width = (num_local_slots + 1) * n + n  # key radix: slot * n + a < width

    mine = a[src == rank]  # [S]
    send_assign = mine[torch.argsort(dest[mine] * width + slot[mine] * n + mine)]  # by (dest, slot, a)
    theirs = a[dest == rank]  # [R]
    arrival = theirs[torch.argsort(src[theirs] * width + slot[theirs] * n + theirs)]  # by (src, slot, a)
    arrival_slot = slot[arrival]  # [R]
    compute_order = None
    if world_size > 1:
        compute_order = torch.argsort(arrival_slot, stable=True)  # [R]
    slot_counts = torch.bincount(arrival_slot, minlength=num_local_slots)  # [L]
    slot_offsets = torch.zeros(num_local_slots + 1, dtype=torch.long)
    slot_offsets[1:] = torch.cumsum(slot_counts.cpu(), 0)
    combine_order = torch.empty_like(send_assign)
    combine_order[send_assign - bounds[rank] * k] = torch.arange(send_assign.shape[0], device=dev)
    return DispatchPlan(
        send_assign=send_assign,
        combine_order=combine_order,
        send_counts=torch.bincount(dest[send_assign], minlength=world_size).tolist(),
        recv_counts=torch.bincount(src[arrival], minlength=world_size).tolist(),
        compute_order=compute_order,
        slot_offsets=slot_offsets,
        slice_start=bounds[rank],
        slice_counts=[bounds[r + 1] - bounds[r] for r in range(world_size)],
        rank_rows=torch.bincount(dest, minlength=world_size).tolist(),
    )
