"""ExpertPlacement: which ranks of the ep group hold which experts of one MoE layer.

Terms. Each expert has a *home* rank (contiguous blocks: with E experts on W ranks, rank r is home
to experts [r E/W, (r+1) E/W)) and optionally *replicas* on other ranks, added by the rebalancer
(workers/parallel/eplb.py) for hot experts. A rank's *slots* are the experts it holds, in ascending
expert order; its local weight tensors are indexed by slot. Tokens routed to a replicated expert
are split evenly across its replicas in a fixed order (see ``moe.build_dispatch_plan``), so every
rank computes the same dispatch from the same routing without exchanging counts.

Worked example: E = 4, W = 2, expert 0 replicated onto rank 1 ->
replicas = ((0, 1), (0,), (1,), (1,)); slots(0) = (0, 1), slots(1) = (0, 2, 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.errors import ConfigError


@dataclass(frozen=True)
class ExpertPlacement:
    world_size: int
    replicas: tuple[tuple[int, ...], ...]  # per expert: ranks holding it, home first

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> ExpertPlacement:
        """Home placement only: expert e on rank e // (E / W)."""
        if num_experts % world_size:
            raise ConfigError(f"ep_size={world_size}: must divide the model's {num_experts} experts")
        per = num_experts // world_size
        return cls(world_size, tuple((e // per,) for e in range(num_experts)))

    def __post_init__(self) -> None:
        for e, ranks in enumerate(self.replicas):
            assert ranks and len(set(ranks)) == len(ranks), f"expert {e}: bad replica ranks {ranks}"
            assert all(0 <= r < self.world_size for r in ranks), f"expert {e}: rank out of range in {ranks}"

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    def home(self, expert: int) -> int:
        return self.replicas[expert][0]

    def slots(self, rank: int) -> tuple[int, ...]:
        """Experts held by ``rank`` in slot order (ascending expert id)."""
        return tuple(e for e, ranks in enumerate(self.replicas) if rank in ranks)

    def with_replicas(self, extra: dict[int, list[int]]) -> ExpertPlacement:
        """The home placement plus ``extra`` replica ranks per expert."""
        return ExpertPlacement(
            self.world_size, tuple((r[0], *extra.get(e, [])) for e, r in enumerate(self.replicas))
        )

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lookup tables for dispatch: num_replicas [E], replica_rank [E, R], replica_slot [E, R]
        (R = most replicas of any expert; unused entries 0)."""
        width = max(len(r) for r in self.replicas)
        slot_of = [{e: i for i, e in enumerate(self.slots(r))} for r in range(self.world_size)]
        ranks = [list(r) + [0] * (width - len(r)) for r in self.replicas]
        slots = [[slot_of[r][e] for r in rs] + [0] * (width - len(rs)) for e, rs in enumerate(self.replicas)]
        return (
            torch.tensor([len(r) for r in self.replicas], device=device),
            torch.tensor(ranks, device=device),
            torch.tensor(slots, device=device),
        )
