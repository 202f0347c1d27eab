"""Drafting: the simulation's speculation state -- which request drafts on which drafter replica,
rows per replica, and each target replica's wait for drafts. The model is cluster/sim/spec.py's
docstring; cluster/sim/simulator.py calls ``join`` / ``leave`` / ``refresh`` at its events.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.sim.pool import PoolState
from cluster.sim.replica import SimReplica
from cluster.sim.spec import SpecModel
from router.policies.base import RouteRequest, WorkerState
from router.policies.drafter import DrafterState, LeastLoadedAffinityPolicy

MARGIN = 0.02  # workers/engine/draft_length.py's: do not speculate for noise


@dataclass
class _Req:
    target: SimReplica
    drafter: SimReplica | None  # None: private drafter, or none at all (k = 0)
    k: int


@dataclass
class Drafting:
    """The simulation's speculation state: which request drafts where, rows per drafter replica,
    and the waits of the target replicas (module docstring)."""

    pools: dict[str, PoolState]
    num_requests: int
    seed: int = 0
    route_candidates: int | None = None
    rng: random.Random = field(init=False)
    acceptance: dict[str, np.ndarray] = field(init=False)  # target pool -> per request a
    reqs: dict[int, _Req] = field(init=False, default_factory=dict)
    uses: dict[str, Counter[Any]] = field(init=False, default_factory=dict)  # target id -> drafter replica -> rows
    served: dict[str, Counter[str]] = field(init=False, default_factory=dict)  # drafter id -> target id -> rows
    policies: dict[str, LeastLoadedAffinityPolicy] = field(init=False, default_factory=dict)
    unserved: dict[str, set[int]] = field(init=False, default_factory=dict)  # drafter pool -> requests that found no room

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.acceptance = {}
        for name, p in self.pools.items():
            sp = p.spec.spec
            if sp is None:
                continue
            g = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            c = sp.concentration
            self.acceptance[name] = np.clip(g.beta(sp.acceptance * c, (1 - sp.acceptance) * c, self.num_requests),
                                            1e-6, 0.999)
            if sp.drafter_pool is not None:
                self.policies[name] = LeastLoadedAffinityPolicy()

    def join(self, r: SimReplica, i: int, now: float) -> tuple[float, int]:
        """Request i starts decoding on target replica r: (tokens per step, drafts per step)."""
        pool = self.pools[r.pool]
        sp = pool.spec.spec
        if sp is None:
            return 1.0, 0
        a = float(self.acceptance[r.pool][i])
        rate = sp.tokens_per_step(a)
        drafter = None
        if sp.drafter_pool is not None:
            drafter = self._pick(pool, r, i)
            if drafter is None:
                pool.spec_counters.fallbacks += 1
                self.unserved.setdefault(sp.drafter_pool, set()).add(i)
                return 1.0, 0
        # The wait stalls every sequence of the batch, so the request pays for the wait it adds
        # (all of it when nothing drafts here yet), in the batch's tokens per step.
        added = self._wait(r, sp, extra=(drafter, 1)) - (self._wait(r, sp) if r.n_spec else 0.0)
        step = r.verify_step_s() + r.svc.decode_per_seq_s + r.wait_s  # with this request decoding plainly
        gain = rate - 1 - (r.rate_sum + 1) * (r.svc.decode_per_seq_s * sp.verify_token_cost * sp.k + added) / step
        if gain <= MARGIN:
            pool.spec_counters.declined += 1
            return 1.0, 0
        pool.spec_counters.speculated += 1
        self.reqs[i] = _Req(r, drafter, sp.k)
        self.uses.setdefault(r.worker_id, Counter())[drafter] += 1
        if drafter is not None:
            drafter.in_flight += 1
            self.served.setdefault(drafter.worker_id, Counter())[r.worker_id] += 1
        return rate, sp.k

    def leave(self, i: int) -> SimReplica | None:
        """Request i finished: free its row; returns its drafter replica (it may leave now)."""
        for waiting in self.unserved.values():
            waiting.discard(i)
        q = self.reqs.pop(i, None)
        if q is None:
            return None
        uses = self.uses[q.target.worker_id]
        uses[q.drafter] -= 1
        if uses[q.drafter] <= 0:
            del uses[q.drafter]
        if q.drafter is not None:
            q.drafter.in_flight -= 1
            served = self.served[q.drafter.worker_id]
            served[q.target.worker_id] -= 1
            if served[q.target.worker_id] <= 0:
                del served[q.target.worker_id]
        return q.drafter

    def refresh(self, r: SimReplica, now: float) -> None:
        """Recompute target replica r's wait for drafts (at its own events; module docstring)."""
        sp = self.pools[r.pool].spec.spec
        if sp is not None:
            r.set_wait(self._wait(r, sp) if r.n_spec else 0.0, now)

    def _wait(self, r: SimReplica, sp: SpecModel, extra: tuple[SimReplica | None, int] | None = None) -> float:
        uses = dict(self.uses.get(r.worker_id, {}))
        if extra is not None:
            uses[extra[0]] = uses.get(extra[0], 0) + extra[1]
        t_verify = r.verify_step_s()
        a = sp.acceptance
        p_hit = a ** sp.k if sp.overlap else 0.0
        worst = 0.0
        for d, n in uses.items():
            if n <= 0:
                continue
            if d is None:  # the private drafter batches this replica's drafting batch rows only
                cost, rows = sp.private, r.n_spec + (extra[1] if extra and extra[0] is None else 0)
            else:
                cost, rows = self.pools[d.pool].spec.draft, d.in_flight + (extra[1] if extra and extra[0] is d else 0)
            assert cost is not None
            full = cost.round_s(rows, sp.k)
            worst = max(worst, p_hit * max(0.0, full - t_verify) + (1 - p_hit) * full)
        return worst

    def _pick(self, pool: PoolState, r: SimReplica, i: int) -> SimReplica | None:
        sp = pool.spec.spec
        assert sp is not None and sp.drafter_pool is not None
        dpool = self.pools[sp.drafter_pool]
        cost = dpool.spec.draft
        assert cost is not None
        cands = [d for d in dpool.routable if d.in_flight < cost.max_rows]
        if not cands:
            return None
        if self.route_candidates is not None and len(cands) > self.route_candidates:
            cands = self.rng.sample(cands, self.route_candidates)
        states = [DrafterState(d.worker_id, "", dpool.name, num_requests=d.in_flight,
                               targets=self.served.get(d.worker_id, {})) for d in cands]
        target = WorkerState(r.worker_id, drafter_pool=dpool.name)
        chosen = self.policies[r.pool].select(RouteRequest(str(i), (), 0), target, states)
        return None if chosen is None else dpool.replicas[chosen]
