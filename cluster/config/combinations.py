"""Checks across sections: which pool roles, parallel sizes, quantization, speculation and placement
can work together. Each refusal names both keys and says what to change; a key's own range, and
combinations inside one lower-layer config, are checked by their owner (workers/config.py: e.g.
model.quantization needs model.dtype float32, a quantized drafter needs float32 too), not here.
Combinations that depend on the model (tp_size vs its heads, ep_size vs its experts, quantized
tp splits on 32-feature blocks) are checked once the model is resolved (cluster/deploy/preflight.py).

Called by cluster/config/duet.py once every section is built, so ``duet serve --dry-run`` refuses the
same combinations as ``duet serve``. The Helm chart refuses the ones it can tell from its values
(values.schema.json and templates/_config.tpl).
"""

from __future__ import annotations

from typing import Any

from cluster.config.sources import Sources, need, source_of


def check_combinations(c: Any, s: Sources) -> None:
    """``c``: the DuetConfig being built."""
    for i, pool in enumerate(c.pools):
        p = f"pools[{i}]"
        _check_role(pool, p, s)
        _check_embedded_resources(c, pool, p, s)
        _check_pool_device(pool, p, s)
        _check_standby(pool, p, s)
    _check_drafter_pools(c, s)


def _check_standby(pool: Any, p: str, s: Sources) -> None:
    """Standby replicas are single-rank engine workers (a gang's ranks load together when it starts;
    a drafter actor has no standby state)."""
    need(pool.standby_replicas == 0 or pool.gang_size == 1, f"{p}.standby_replicas", pool.standby_replicas, s,
         f"{p} is a gang of {pool.gang_size} ranks (ep_size x sp_size x tp_size): standby replicas are single-rank "
         "workers; set standby_replicas to 0 or the parallel sizes to 1")
    need(pool.standby_replicas == 0 or pool.role != "drafter", f"{p}.standby_replicas", pool.standby_replicas, s,
         f"{p}.role is 'drafter': standby replicas are engine workers; a drafter pool keeps none (set 0)")


def _check_drafter_pools(c: Any, s: Sources) -> None:
    """A drafter pool has a model and nothing a target has; every speculative.drafter_pool names
    one; every drafter pool is named (else its replicas would serve nobody)."""
    roles = {pool.name: pool.role for pool in c.pools}
    named = {pool.speculative.drafter_pool for pool in c.pools if pool.speculative.drafter_pool}
    for i, pool in enumerate(c.pools):
        p = f"pools[{i}]"
        if pool.role == "drafter":
            need(bool(pool.drafter.model), f"{p}.drafter.model", pool.drafter.model, s,
                 f"{p}.role is 'drafter': name the draft model (a checkpoint dir or model name sharing the target's "
                 "tokenizer)")
            need(pool.speculative.method == "none", f"{p}.speculative.method", pool.speculative.method, s,
                 f"with {p}.role='drafter': a drafter pool drafts for others; speculate on the pools that name it")
            need(pool.gang_size == 1, f"{p}.tp_size", pool.tp_size, s,
                 f"with {p}.role='drafter': a drafter replica is one rank (ep_size, sp_size and tp_size 1)")
            need(pool.name in named, f"{p}.name", pool.name, s,
                 "no pool's speculative.drafter_pool names this drafter pool, so it would serve nobody; set "
                 f"speculative.drafter_pool: {pool.name} on a colocated or decode pool, or remove it")
        else:
            need(not pool.drafter.model, f"{p}.drafter.model", pool.drafter.model, s,
                 f"only a role: drafter pool runs a drafter ({p}.role is {pool.role!r}); for a private drafter "
                 "per worker set speculative.draft_model instead")
        target = pool.speculative.drafter_pool
        if target is not None:
            need(roles.get(target) == "drafter", f"{p}.speculative.drafter_pool", target, s,
                 f"must name a pool with role drafter; drafter pools: "
                 f"{', '.join(n for n, r in roles.items() if r == 'drafter') or '(none)'}")


def _check_pool_device(pool: Any, p: str, s: Sources) -> None:
    """A pool that asks for CUDA must reserve GPUs (Ray gives a rank no GPU otherwise); CUDA graphs
    are captured by a one-rank replica's ModelRunner only (a gang's runner has none)."""
    dev = pool.engine.device
    need(not dev.startswith("cuda") or pool.gpus_per_rank > 0, f"{p}.engine.device", dev, s,
         f"{p}.gpus_per_rank is 0: a rank gets no GPU; set {p}.gpus_per_rank (e.g. 1) or device to auto / cpu")
    need(not pool.engine.cuda_graphs or pool.gang_size == 1, f"{p}.engine.cuda_graphs", pool.engine.cuda_graphs, s,
         f"with {p}.tp_size={pool.tp_size}, ep_size={pool.ep_size}, sp_size={pool.sp_size}: a gang of ranks runs "
         "without CUDA graphs (only a one-rank replica captures them); set cuda_graphs to false")
    draft = pool.speculative.drafter_device
    need(draft != "cuda" or pool.gpus_per_rank > 0 or dev.startswith("cuda"), f"{p}.speculative.drafter_device",
         draft, s, f"{p}.gpus_per_rank is 0: a drafter on cuda beside a CPU target gets no GPU; use cpu or auto")


def _check_role(pool: Any, p: str, s: Sources) -> None:
    need(pool.speculative.method == "none" or pool.role != "prefill", f"{p}.speculative.method",
         pool.speculative.method, s,
         f"with {p}.role='prefill' ({source_of(f'{p}.role', s)}): a prefill pool produces one token per request; "
         "speculate on the decode pool")


def _check_embedded_resources(c: Any, pool: Any, p: str, s: Sources) -> None:
    """An embedded Ray (ray.address unset) offers CPUs (and this machine's GPUs) only: a custom
    resource asked for there could never be placed."""
    if c.ray.address is not None:
        return
    embedded = f"with ray.address unset ({source_of('ray.address', s)}): an embedded Ray offers no custom resources"
    need(not pool.resources_per_rank, f"{p}.resources_per_rank", dict(pool.resources_per_rank), s,
         f"{embedded}; set ray.address to a cluster whose nodes offer them, or drop them")
    need(pool.speculative.method != "draft_model" or not pool.speculative.drafter_resources,
         f"{p}.speculative.drafter_resources", dict(pool.speculative.drafter_resources), s,
         f"{embedded}; set ray.address to a cluster with drafter nodes, or drop them (the drafter then "
         "runs on this machine's CPUs)")
