"""SparseMoE (workers/layers/moe.py) on one rank against a per-token loop that states the math
(softmax over E, top-k, renormalise, weighted sum of SwiGLU experts); the dispatch plan's worked
example; and the routing function against transformers' MixtralTopKRouter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.layers.moe import SparseMoE, route
from workers.layers.moe_dispatch import build_dispatch_plan
from workers.parallel.expert_placement import ExpertPlacement
from workers.parallel.groups import get_group

from testkit.tolerance import KERNEL_FP32


def _layer(h=32, i=48, e=8, k=2, seed=0) -> SparseMoE:
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(h, i, e, k, get_group("ep"))
    moe.gate.weight.copy_(torch.randn(e, h, generator=g))
    moe.experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h, generator=g) / h**0.5)
    moe.experts.down_proj.copy_(torch.randn(e, h, i, generator=g) / i**0.5)
    return moe


def _loop_ref(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    i = moe.inter
    for t in range(x.shape[0]):
        p = torch.softmax(x[t] @ moe.gate.weight.T, -1)
        top_p, top_e = torch.topk(p, moe.top_k)
        for w, e in zip(top_p / top_p.sum(), top_e.tolist()):
            gu = moe.experts.gate_up_proj[e] @ x[t]
            out[t] += w * (moe.experts.down_proj[e] @ (F.silu(gu[:i]) * gu[i:]))
    return out


@pytest.mark.parametrize("t", [1, 5, 40])
def test_matches_per_token_loop(t):
    moe = _layer()
    x = torch.randn(t, 32, generator=torch.Generator().manual_seed(t))
    with torch.inference_mode():
        KERNEL_FP32.assert_close(moe(x), _loop_ref(moe, x))
    assert moe.expert_counts.sum().item() == 2 * t and moe.rank_rows.tolist() == [2 * t]


def test_empty_batch():
    moe = _layer()
    assert moe(torch.empty(0, 32)).shape == (0, 32)


def test_route_matches_transformers_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2)
    router = MixtralTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 16)
    _, scores, idx = router(x)
    w, e = route(x @ router.weight.T, 2)
    assert torch.equal(e, idx)
    KERNEL_FP32.assert_close(w, scores)


def test_dispatch_plan_worked_example():
    """The example in moe_dispatch.py's docstring: T=2, k=2, W=2, experts [[0, 3], [1, 0]]."""
    tables = ExpertPlacement.contiguous(4, 2).tables()
    experts = torch.tensor([[0, 3], [1, 0]])
    p0 = build_dispatch_plan(experts, *tables, 2, rank=0, world_size=2)
    p1 = build_dispatch_plan(experts, *tables, 2, rank=1, world_size=2)
    assert p0.send_assign.tolist() == [0, 1] and p0.send_counts == [1, 1] and p0.recv_counts == [1, 2]
    assert p1.send_assign.tolist() == [3, 2] and p1.send_counts == [2, 0] and p1.recv_counts == [1, 0]
    assert p0.slot_offsets.tolist() == [0, 2, 3] and p0.compute_order.tolist() == [0, 1, 2]
    assert p0.rank_rows == [3, 1] == p1.rank_rows


def test_replicas_split_evenly():
    """Expert 0 replicated on both ranks: its 6 assignments split 3 / 3 in token order."""
    placement = ExpertPlacement.contiguous(4, 2).with_replicas({0: [1]})
    experts = torch.tensor([[0, 1]] * 6)
    plan = build_dispatch_plan(experts, *placement.tables(), len(placement.slots(0)), 0, 2)
    assert plan.rank_rows == [9, 3]
    assert placement.slots(1) == (0, 2, 3)
