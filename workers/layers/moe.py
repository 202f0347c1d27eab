"""Sparse mixture-of-experts MLP (Mixtral): top-k routing, dispatch by expert, grouped expert GEMM,
weighted combine -- with expert parallelism (EP) inside the layer.

Math (Mixtral): p = softmax(x W_gate^T) over E experts (fp32); the token's top-k experts get weights
p_j / sum of its top-k p; out = sum_j w_j * down_j(silu(gate_j(x)) * up_j(x)).

Expert parallelism: the ep group's W ranks each hold a subset of the experts (ExpertPlacement,
possibly with replicas of hot experts). Hidden states are replicated on every rank (attention runs
replicated), so every rank routes all T tokens identically. Each rank then takes its contiguous
slice of the tokens, sends every (token, expert) assignment of its slice to a rank holding the
expert (all-to-all with uneven splits), computes what it received with the grouped GEMM, sends the
results back (all-to-all), combines its slice with the routing weights, and an all-gather of the
slices restores the full [T, H] output on every rank. With W = 1 the same code runs with identity
collectives. Bytes per token and layer over all W ranks (fp32, H hidden; experts evenly used):
dispatch + combine 2 k H 4 (W-1)/W, plus the all-gather H 4 (W-1) -- the all-gather is the price of
replicated attention; with data-parallel attention each rank would own its slice and skip it.
(The upcycled SmolLM2 at W = 2: 4.6 KB + 2.3 KB per token and layer, ~210 KB per token.)

Load: ``expert_counts`` [E] accumulates the assignments routed to each expert (identical on every
rank); ``rank_rows`` [W] the assignments each rank computed. The rebalancer reads them.

Axes: T tokens, H hidden, I expert MLP width, E experts, k experts per token, L local expert slots,
S/R assignments sent/received by this rank, W ep ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.grouped_gemm import grouped_gemm
from kernels.silu_and_mul import silu_and_mul
from workers.layers.linear import Linear
from workers.layers.moe_dispatch import build_dispatch_plan
from workers.parallel import comm
from workers.parallel.expert_placement import ExpertPlacement
from workers.parallel.groups import GroupCoordinator


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, experts [T, k] int64). The weights are the
    top-k softmax probabilities, renormalised to sum to 1 per token if ``renormalize`` (Mixtral;
    Qwen2-MoE's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    top_p, top_e = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    return (top_p / top_p.sum(dim=-1, keepdim=True) if renormalize else top_p), top_e


class ExpertWeights(nn.Module):
    """This rank's experts, stacked by slot: gate_up_proj [L, 2I, H] ([gate; up] rows), down_proj [L, H, I]."""

    def __init__(self, num_slots: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_slots, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_slots, hidden, inter), requires_grad=False)


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer; parameter names follow transformers 5 (mlp.gate, mlp.experts.*)."""

    expert_counts: torch.Tensor  # buffers (registered in __init__)
    rank_rows: torch.Tensor
    comm_rows: torch.Tensor

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, ep: GroupCoordinator,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.hidden, self.inter, self.num_experts, self.top_k, self.ep = hidden, inter, num_experts, top_k, ep
        self.renormalize = renormalize
        self.gate = Linear(hidden, num_experts)  # router: [E, H]
        self.home = ExpertPlacement.contiguous(num_experts, ep.world_size)
        self.placement = self.home
        self.experts = ExpertWeights(len(self.home.slots(ep.rank)), hidden, inter)
        self._slot_of = {e: i for i, e in enumerate(self.placement.slots(ep.rank))}
        self._tables = self.placement.tables()
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("rank_rows", torch.zeros(ep.world_size, dtype=torch.long), persistent=False)
        # rows this rank sent to other ranks in the dispatch (the combine sends as many back), and
        # rows it received from other ranks in the all-gather (padded): traffic accounting
        self.register_buffer("comm_rows", torch.zeros(2, dtype=torch.long), persistent=False)

    def _dispatch_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The placement's lookup tables on the routing tensors' device (moved once per placement)."""
        if self._tables[0].device != device:
            a, b, c = (t.to(device) for t in self._tables)
            self._tables = a, b, c
        return self._tables

    # ------------------------------------------------------------- loading
    def expected_shards(self) -> set[str]:
        """Shard ids a complete checkpoint fills: '<e>.gate', '<e>.up', '<e>.down' for every expert."""
        return {f"{e}.{part}" for e in range(self.num_experts) for part in ("gate", "up", "down")}

    def load_expert(self, kind: str, tensor: torch.Tensor, expert: int | None) -> set[str]:
        """Copy a checkpoint tensor into the local slots; returns the shard ids it covered.

        kind 'gate_up' ([E, 2I, H], or [2I, H] for one expert), 'down' ([E, H, I] or [H, I]),
        'gate' / 'up' ([I, H], one expert: the per-expert w1 / w3 or gate_proj / up_proj of
        per-expert checkpoints)."""
        experts = range(self.num_experts) if expert is None else [expert]
        parts = {"gate_up": ("gate", "up"), "down": ("down",), "gate": ("gate",), "up": ("up",)}[kind]
        for i, e in enumerate(experts):
            slot = self._slot_of.get(e)
            if slot is None:
                continue  # another rank's expert
            src = tensor[i] if expert is None else tensor
            if kind == "down":
                dst = self.experts.down_proj[slot]
            else:
                rows = {"gate_up": (0, 2 * self.inter), "gate": (0, self.inter), "up": (self.inter, self.inter)}[kind]
                dst = self.experts.gate_up_proj[slot].narrow(0, *rows)
            assert dst.shape == src.shape, (kind, e, dst.shape, src.shape)
            dst.copy_(src)
        return {f"{e}.{p}" for e in experts for p in parts}

    # ------------------------------------------------------------- forward
    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k] fp32, experts [T, k]); other routers override this."""
        return route(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        if t == 0:
            return x
        weights, experts = self.select(x)  # [T, k], [T, k]
        self.expert_counts += torch.bincount(experts.view(-1), minlength=self.num_experts)
        plan = build_dispatch_plan(experts, *self._dispatch_tables(experts.device), self.experts.gate_up_proj.shape[0], self.ep.rank,
                                   self.ep.world_size)
        self.rank_rows += torch.tensor(plan.rank_rows, device=self.rank_rows.device)
        if self.ep.world_size > 1:
            me = self.ep.rank
            self.comm_rows[0] += sum(plan.send_counts) - plan.send_counts[me]
            self.comm_rows[1] += (self.ep.world_size - 1) * max(plan.slice_counts)
        sent = x[plan.send_assign // self.top_k]  # [S, H]
        got = comm.all_to_all_rows(sent, plan.send_counts, plan.recv_counts, self.ep)  # [R, H], arrival order
        if plan.compute_order is not None:
            got = got[plan.compute_order]  # [R, H], grouped by slot
        h = grouped_gemm(got, self.experts.gate_up_proj, plan.slot_offsets)  # [R, 2I]
        h = grouped_gemm(silu_and_mul(h), self.experts.down_proj, plan.slot_offsets)  # [R, H]
        if plan.compute_order is not None:
            h = torch.empty_like(h).index_copy_(0, plan.compute_order, h)  # back to arrival order
        back = comm.all_to_all_rows(h, plan.recv_counts, plan.send_counts, self.ep)  # [S, H], send order
        # combine: gather the slice's rows token-major and sum each token's k weighted rows (a
        # gather + sum, not index_add_: torch's parallel index_add_ is far slower on a busy CPU;
        # benchmarks/README.md, "Figures moved out of the code")
        n_local, lo = plan.slice_counts[self.ep.rank], plan.slice_start
        w = weights[lo:lo + n_local].reshape(-1, 1).to(back.dtype)  # [T_slice k, 1]
        out = (back[plan.combine_order] * w).view(n_local, self.top_k, self.hidden).sum(1)  # [T_slice, H]
        return comm.all_gather_rows(out, plan.slice_counts, self.ep)  # [T, H]

    # --------------------------------------------------------- rebalancing
    def set_placement(self, placement: ExpertPlacement) -> None:
        """Switch to a new placement (collective over the ep group, between steps). Replicas keep
        the home placement's experts; each new replica's weights come from the expert's home rank."""
        assert placement.world_size == self.ep.world_size and placement.num_experts == self.num_experts
        assert all(p[0] == h[0] for p, h in zip(placement.replicas, self.home.replicas)), "home ranks must not move"
        me = self.ep.rank
        old_slots, new_slots = self._slot_of, {e: i for i, e in enumerate(placement.slots(me))}
        gu = self.experts.gate_up_proj.new_empty(len(new_slots), 2 * self.inter, self.hidden)  # [L', 2I, H]
        dn = self.experts.down_proj.new_empty(len(new_slots), self.hidden, self.inter)  # [L', H, I]
        for e, slot in new_slots.items():
            if e in old_slots:
                gu[slot], dn[slot] = self.experts.gate_up_proj[old_slots[e]], self.experts.down_proj[old_slots[e]]
        # Every rank walks the same transfer list in the same order, so blocking send/recv pair up.
        for e, ranks in enumerate(placement.replicas):
            home = ranks[0]
            for r in ranks[1:]:
                if r in self.placement.replicas[e]:
                    continue  # already there
                if me == home:
                    comm.send_tensor(self.experts.gate_up_proj[old_slots[e]], r, self.ep)
                    comm.send_tensor(self.experts.down_proj[old_slots[e]], r, self.ep)
                elif me == r:
                    comm.recv_tensor(gu[new_slots[e]], home, self.ep)
                    comm.recv_tensor(dn[new_slots[e]], home, self.ep)
        self.experts.gate_up_proj = nn.Parameter(gu, requires_grad=False)
        self.experts.down_proj = nn.Parameter(dn, requires_grad=False)
        self.placement, self._slot_of, self._tables = placement, new_slots, placement.tables()
