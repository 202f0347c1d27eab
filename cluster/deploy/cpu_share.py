"""The embedded default uses the machine: unset ``cpus_per_replica`` filled in from the CPUs an
embedded Ray offers (``duet serve`` without ``ray.address``), after the router's share.

Worked example: 8 CPUs, one colocated pool of 1 replica with cpus_per_replica unset -> 7 CPUs (and
7 torch threads) for the worker, 1 left to the router; with ray.address set the nodes are not
visible from here, so unset pools get 1 CPU per rank.
"""

from __future__ import annotations

from cluster.config.duet import DuetConfig


ROUTER_CPUS = 1  # what an embedded deployment leaves the router (its gRPC server and detokenizer)


def resolve_cpus(c: DuetConfig, node_cpus: int | None) -> tuple[DuetConfig, str]:
    """``c`` with every unset ``cpus_per_replica`` filled in, and a phrase saying what was chosen.

    node_cpus: the CPUs an embedded Ray offers (None: an existing cluster, whose nodes this process
    cannot see: 1 CPU per rank). Embedded, the CPUs left after the explicit pools, the drafters and
    ``ROUTER_CPUS`` are shared evenly among the ranks of the pools that leave it unset (at least 1).
    An autoscaled pool counts at its ``max_replicas``, so the replicas it may add have room too, and
    standby replicas count like serving ones (each reserves its CPUs)."""
    unset = [p for p in c.pools if p.cpus_per_replica is None]
    if not unset:
        return c, "cpus_per_replica as configured"
    if node_cpus is None:
        chosen = 1
        why = "1 (ray.address is set: size pools with cpus_per_replica)"
    else:
        scaled = {a.pool: a for a in c.autoscaling.pools} if c.autoscaling.enabled else {}

        def replicas(p) -> int:
            a = scaled.get(p.name)
            return max(p.replicas, a.max_replicas if a else 0) + max(p.standby_replicas, a.max_standby if a else 0)
        fixed = sum(replicas(p) * p.gang_size * p.cpus_per_replica for p in c.pools if p.cpus_per_replica is not None)
        drafters = sum(replicas(p) * p.speculative.drafter_cpus for p in c.pools  # private drafter actors
                       if p.speculative.method == "draft_model" and not p.speculative.drafter_pool)
        ranks = sum(replicas(p) * p.gang_size for p in unset)
        left = node_cpus - ROUTER_CPUS - fixed - drafters
        chosen = max(1, left // ranks)
        why = (f"{chosen} ({node_cpus} CPUs, {ROUTER_CPUS} left to the router"
               + (f", {fixed + drafters} to explicit pools and drafters" if fixed + drafters else "")
               + f", {ranks} rank{'s' if ranks > 1 else ''})")
    pools = tuple(p.model_copy(update={"cpus_per_replica": chosen}) if p.cpus_per_replica is None else p for p in c.pools)
    names = ", ".join(p.name for p in unset)
    return c.model_copy(update={"pools": pools}), f"cpus_per_replica of {names}: {why}"
