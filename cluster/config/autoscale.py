"""The ``autoscaling`` section of the Duet config: turns the SLO autoscaler on in ``duet serve``.

Built and checked with the rest of the config (cluster/config/duet.py; every error names the key, its
source and the fix), then turned into the decision function's ``AutoscalerConfig``
(cluster/autoscale/slo.py) by ``to_autoscaler_config``. Terms are the autoscaler's; per pool:

    slo_ttft_ms / slo_tpot_ms   p90 targets: prefill pools scale on TTFT, decode pools on TPOT,
                                colocated pools on both (each role needs its targets)
    profile                     a capacity profile of one replica (``duet profile --out FILE``)
    min_replicas / max_replicas bounds; min 0 = scale to zero after ``scale_to_zero_after_s`` idle
                                (a request then waits while the router has the controller wake the
                                pool: router/hold.py, cluster/deploy/wake.py)
    max_standby / standby_cost  standby replicas the autoscaler keeps from the burst risk it sees
                                (cluster/autoscale/standby.py), and one standby's cost in replicas
    ratio                       drafter pools only (instead of SLOs and a profile): replicas per
                                replica of the pool that drafts on it (its speculative.drafter_pool),
                                which must be scaled too: ceil(ratio x that pool's desired) -- the
                                size while no draft demand is measured
    rows_per_replica            drafter pools: scale on draft demand instead (cluster/autoscale/drafter.py):
                                requests drafting per replica it batches within a round that pays
    min_speedup, verify_token_cost, min_verifies
                                drafter pools: the measured benefit under which the pool shrinks to
                                its minimum (drafting does not pay), the target's cost of verifying a
                                draft token (per plain decode row), verifies before it is judged

Example (YAML)::

    autoscaling:
      enabled: true
      interval_s: 10
      pools:
        - {pool: decode, slo_tpot_ms: 100, profile: profiles/smollm2.json, min_replicas: 1, max_replicas: 4}
      # on Kubernetes without KubeRay's in-tree autoscaler (the Helm chart renders this):
      actuator: kubernetes
      kubernetes: {raycluster: duet-duet, namespace: serving}

actuator: who applies the decisions (cluster/deploy/kuberay_actuator.py ``make_actuator``):
    ray         this process's Ray cluster: worker actors are added (placement groups wait for
                room) and drained; the capacity itself is someone else's (KubeRay's in-tree
                autoscaler, or a fixed cluster)
    kubernetes  the same, plus the pool's KubeRay worker group is resized to match (one pod per
                replica, as the chart lays pools out): pods first on the way up, pods last (after
                the drain) on the way down
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import Field
from pydantic.json_schema import JsonDict

from cluster.config.derive import Section
from cluster.config.sources import ClusterConfigError, Sources, need, source_of

Actuator = Literal["ray", "kubernetes"]
ScaleDown = Literal["drain", "migrate"]  # = cluster.autoscale.slo.SCALE_DOWN (imported lazily there)
ACTUATORS: tuple[str, ...] = get_args(Actuator)
SCALE_DOWN: tuple[str, ...] = get_args(ScaleDown)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MS = "must be a number of milliseconds > 0, or null"
_DRAFTER_ONLY = frozenset({"rows_per_replica", "min_speedup", "verify_token_cost", "min_verifies"})


class AutoscalePoolSection(Section):
    """How one pool of ``pools`` scales (module docstring; cluster/autoscale/slo.py PoolScaling)."""

    pool: str = Field("", min_length=1, description="The pool of `pools` to scale.",
                      json_schema_extra={"hint": "must name a pool of `pools` to scale"})
    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 = scale to zero after "
                              "autoscaling.scale_to_zero_after_s idle (a request then waits while the pool wakes: "
                              "router.wake_timeout_s).")
    max_replicas: int = Field(8, ge=1, description="Most replicas.")
    slo_ttft_ms: float | None = Field(None, gt=0, description="p90 time-to-first-token target (prefill and colocated "
                                      "pools).", json_schema_extra={"hint": _MS})
    slo_tpot_ms: float | None = Field(None, gt=0, description="p90 time-per-output-token target (decode and "
                                      "colocated pools).", json_schema_extra={"hint": _MS})
    profile: str | None = Field(None, description="Capacity profile of one replica (`duet profile --out FILE`).")
    smoothing_s: float = Field(0.0, ge=0, description="Arrival-rate time constant, ~ a request's stay in the pool "
                               "(0 = per bucket).", json_schema_extra={"hint": "must be >= 0 seconds (0 = per bucket)"})
    headroom: float | None = Field(None, ge=0, description="Spare capacity fraction (null = 0.1).")
    max_standby: int = Field(0, ge=0, description="Most standby replicas (loaded, unrouted; promoted first on a "
                             "scale-up) the autoscaler keeps, sized from the bursts it saw lately; 0 = leave the "
                             "pool's standby_replicas alone.", json_schema_extra={"hint": "must be >= 0"})
    standby_cost: float = Field(0.1, ge=0, description="One standby replica's cost in serving replicas (its "
                                "process and reservation without a KV cache or, with shared weights, a weight "
                                "copy); reported with each decision.", json_schema_extra={"hint": "must be >= 0"})
    ratio: float | None = Field(None, gt=0, description="Drafter pools only, instead of SLOs and a profile: replicas "
                                "per replica of the pool drafting on it (its speculative.drafter_pool, scaled too): "
                                "ceil(ratio x that pool's desired); with rows_per_replica, the size until draft demand "
                                "is measured.", json_schema_extra={
                                    "hint": "must be > 0 (drafter replicas per replica of the pool drafting on them), "
                                            "or null"})
    rows_per_replica: float | None = Field(None, gt=0, description="Drafter pools only: scale on draft demand -- "
                                           "requests drafting per replica that one replica batches within a round "
                                           "that still pays (benchmarks/drafter_pool_bench.py); null = follow ratio "
                                           "only.", json_schema_extra={
                                               "hint": "must be > 0 (drafting requests per drafter replica), or null"})
    min_speedup: float = Field(1.1, ge=0, description="Drafter pools with rows_per_replica: the measured speed-up of "
                               "the speculating requests under which drafting does not pay and the pool shrinks to "
                               "min_replicas (0 = never).", json_schema_extra={"hint": "must be >= 0 (0 = never)"})
    verify_token_cost: float = Field(0.05, ge=0, description="Drafter pools with rows_per_replica: what verifying one "
                                     "draft token adds to a target step, per plain decode row (GPU ~0.05, the CPU q4 "
                                     "kernel ~0.3).", json_schema_extra={"hint": "must be >= 0"})
    min_verifies: int = Field(100, ge=1, description="Drafter pools with rows_per_replica: verifies a metrics window "
                              "needs before its speed-up is judged.")


class KubernetesActuatorSection(Section):
    """Where the ``kubernetes`` actuator finds its RayCluster. Credentials: the pod's service account
    (in-cluster config), else the current kubeconfig context."""

    raycluster: str = Field("", description="The RayCluster's name (the chart's <release>-duet).")
    namespace: str = Field("", description="Its namespace; empty = this pod's own (read from the service account).")


_SECONDS: JsonDict = {"hint": "must be >= 0 seconds"}


class AutoscalingSection(Section):
    """The SLO autoscaler in ``duet serve`` (module docstring; cluster/autoscale/slo.py)."""

    enabled: bool = Field(False, description="Run the autoscaling loop in `duet serve`.")
    interval_s: float = Field(10.0, gt=0, description="One decision round (and one metrics bucket) per interval.",
                              json_schema_extra={"hint": "must be > 0 seconds"})
    window_buckets: int = Field(30, ge=2, description="Buckets of arrival history: forecast and scale-down window.",
                                json_schema_extra={"hint": "must be >= 2 (20+ is better)"})
    latency_buckets: int = Field(3, ge=1, description="The latest buckets the p90 TTFT/TPOT are taken over "
                                 "(<= window_buckets).")
    horizon_s: float = Field(60.0, gt=0, description="How far ahead the arrival rate is forecast (~ a replica's "
                             "start-up time).", json_schema_extra={"hint": "must be > 0 seconds"})
    short_window_s: float = Field(30.0, ge=0, description="Burst window: a step above the smoothed rate is planned "
                                  "for at once (0 = off; cluster/autoscale/forecast.py).", json_schema_extra=_SECONDS)
    up_cooldown_s: float = Field(30.0, ge=0, description="Seconds between reactive (SLO breach) steps.",
                                 json_schema_extra=_SECONDS)
    down_cooldown_s: float = Field(300.0, ge=0, description="Seconds from a scale-up to the next scale-down.",
                                   json_schema_extra=_SECONDS)
    down_interval_s: float = Field(60.0, ge=0, description="Seconds between scale-downs.", json_schema_extra=_SECONDS)
    scale_down: ScaleDown = Field("drain", description="How a replica is removed: drain (its requests "
                                            "finish there) or migrate (they move to the replicas that stay; needs an "
                                            "actuator that migrates).", json_schema_extra={
                                                "hint": "must be drain (removed replicas finish their requests) or "
                                                        "migrate (they move them to the replicas that stay)"})
    migration_s: float = Field(10.0, ge=0, description="Seconds a migration takes to empty one replica (~ its running "
                               "requests x (their KV bytes / link bandwidth + a pause each)); with scale_down: "
                               "migrate the scale-down waits shrink to at most horizon_s + migration_s.",
                               json_schema_extra=_SECONDS)
    drain_grace_s: float = Field(300.0, ge=0, description="How long a removed replica's in-flight requests may take "
                                 "to finish (the rest resume elsewhere).", json_schema_extra=_SECONDS)
    standby_memory_s: float = Field(3600.0, gt=0, description="How long a burst keeps standby replicas ready for "
                                    "the next one (the time constant its memory decays with).",
                                    json_schema_extra={"hint": "must be > 0 seconds"})
    scale_to_zero_after_s: float = Field(300.0, ge=0, description="A pool with min_replicas 0 goes to zero after "
                                         "this long idle (no arrival, nothing running, queued or starting).",
                                         json_schema_extra=_SECONDS)
    metrics_urls: tuple[str, ...] = Field((), description="The routers' /metrics (`duet router --metrics-port`), "
                                          "each http(s)://host:port/metrics, or dns+http(s)://name:port/metrics to "
                                          "read every address name resolves to each round (a headless Service of "
                                          "N router replicas); omit it when `duet serve` runs the routers itself.")
    pools: tuple[AutoscalePoolSection, ...] = Field((), description="The pools to scale, each with its SLOs, "
                                                    "profile and bounds.")
    actuator: Actuator = Field("ray", description="ray: add/drain worker actors here | kubernetes: also "
                                         "resize the pool's KubeRay worker group (cluster/deploy/kuberay_actuator.py).")
    kubernetes: KubernetesActuatorSection = Field(default_factory=KubernetesActuatorSection,
                                                  description="Where the kubernetes actuator finds its RayCluster.")


def check_autoscale_pool(p: AutoscalePoolSection, key: str, s: Sources) -> None:
    need(p.min_replicas <= p.max_replicas, f"{key}.min_replicas", p.min_replicas, s,
         f"must be >= 0 and <= max_replicas ({p.max_replicas})")
    if p.ratio is not None:
        return  # a drafter pool follows its targets: no SLO, no profile (check_against_pools)
    need(p.profile is not None and Path(p.profile).expanduser().is_file(), f"{key}.profile", p.profile, s,
         "must be a capacity profile file; measure one with `duet profile --out FILE`")
    _load(p, key, s)


def check_autoscaling(a: AutoscalingSection, key: str, s: Sources) -> None:
    for i, p in enumerate(a.pools):
        check_autoscale_pool(p, f"{key}.pools[{i}]", s)
    need(a.latency_buckets <= a.window_buckets, f"{key}.latency_buckets", a.latency_buckets, s,
         f"must be between 1 and window_buckets ({a.window_buckets})")
    for i, url in enumerate(a.metrics_urls):
        need(url.startswith(("http://", "https://", "dns+http://", "dns+https://")), f"{key}.metrics_urls[{i}]", url, s,
             "must be a router's metrics URL, e.g. http://router:9090/metrics, or dns+http://router-headless:9090/metrics "
             "for every router a name resolves to")
    _check_actuator(a, key, s)
    names = [p.pool for p in a.pools]
    need(len(set(names)) == len(names), f"{key}.pools", names, s, "each pool may be listed once")
    need(not a.enabled or bool(a.pools), f"{key}.pools", names, s,
         "autoscaling is enabled but lists no pool to scale; add one (pool, SLO, profile, bounds)")


def _check_actuator(a: AutoscalingSection, key: str, s: Sources) -> None:
    k = a.kubernetes
    if a.actuator != "kubernetes":
        need(k == KubernetesActuatorSection(), f"{key}.kubernetes.raycluster", k.raycluster, s,
             "is only read with actuator: kubernetes; set autoscaling.actuator=kubernetes or remove it")
        return
    need(bool(_DNS_SUBDOMAIN.match(k.raycluster)), f"{key}.kubernetes.raycluster", k.raycluster, s,
         "must name the RayCluster whose worker groups host the pools (the Helm chart's <release>-duet)")
    need(k.namespace == "" or bool(_DNS_LABEL.match(k.namespace)), f"{key}.kubernetes.namespace", k.namespace, s,
         "must be a Kubernetes namespace name, or empty for this pod's own namespace")


def check_against_pools(a: AutoscalingSection, roles: dict[str, str], sizes: dict[str, int], s: Sources,
                        leaders: dict[str, list[str]] | None = None) -> None:
    """Each scaled pool exists, starts within its bounds and has the SLOs its role scales on (the
    rest of DuetConfig's checks). leaders: drafter pool -> the pools drafting on it."""
    leaders = leaders or {}
    scaled = {p.pool for p in a.pools}
    for i, p in enumerate(a.pools):
        key = f"autoscaling.pools[{i}]"
        need(p.pool in roles, f"{key}.pool", p.pool, s, f"must be one of the configured pools ({', '.join(roles)})")
        need(p.min_replicas <= sizes[p.pool] <= p.max_replicas, f"{key}.min_replicas", p.min_replicas, s,
             f"pool {p.pool!r} starts with {sizes[p.pool]} replicas (its `replicas`), outside "
             f"[min_replicas, max_replicas] = [{p.min_replicas}, {p.max_replicas}]; make them agree")
        role = roles[p.pool]
        need((role == "drafter") == (p.ratio is not None), f"{key}.ratio", p.ratio, s,
             f"pool {p.pool!r} is a {role} pool: " + ("a drafter pool follows the pool drafting on it; set ratio "
                                                       "(drafter replicas per replica of that pool)" if role == "drafter"
                                                       else "ratio is for drafter pools only; remove it"))
        if role == "drafter":
            lead = leaders.get(p.pool, [])
            need(len(lead) == 1 and lead[0] in scaled, f"{key}.pool", p.pool, s,
                 f"a drafter pool follows the one pool drafting on it, autoscaled too (drafting on it: "
                 f"{', '.join(lead) or 'none'}; autoscaled: {', '.join(sorted(scaled))})")
            continue
        set_ = sorted(k for k in _DRAFTER_ONLY if getattr(p, k) != AutoscalePoolSection.model_fields[k].default)
        need(not set_, f"{key}.{set_[0] if set_ else 'rows_per_replica'}", getattr(p, set_[0]) if set_ else None, s,
             f"pool {p.pool!r} is a {role} pool: {', '.join(set_)} are for drafter pools only; remove them")
        need(role == "decode" or p.slo_ttft_ms is not None, f"{key}.slo_ttft_ms", None, s,
             f"pool {p.pool!r} is a {role} pool: it scales on TTFT; set a p90 target in ms")
        need(role == "prefill" or p.slo_tpot_ms is not None, f"{key}.slo_tpot_ms", None, s,
             f"pool {p.pool!r} is a {role} pool: it scales on time per output token; set a p90 target in ms")


def to_autoscaler_config(a: AutoscalingSection, roles: dict[str, str], leaders: dict[str, list[str]] | None = None) -> Any:
    """The decision function's ``cluster.autoscale.slo.AutoscalerConfig`` for this section
    (leaders: drafter pool -> the pool drafting on it, which it follows)."""
    leaders = leaders or {}
    from cluster.autoscale.slo import AutoscalerConfig, AutoscalerConfigError, PoolScaling
    from cluster.autoscale.profile import SLOTargets

    # A P/D deployment's decode pools are fed by its prefill pool: with exactly one scaled, a
    # decode pool's bursts are planned for at most what it admits (cluster/autoscale/forecast.py).
    prefill = [p.pool for p in a.pools if roles[p.pool] == "prefill"]
    fed_by = prefill[0] if len(prefill) == 1 else None
    pools = tuple(
        PoolScaling(p.pool, "drafter", min_replicas=p.min_replicas, max_replicas=p.max_replicas,
                    follows=leaders[p.pool][0], ratio=1.0 if p.ratio is None else p.ratio, headroom=p.headroom,
                    rows_per_replica=p.rows_per_replica, min_speedup=p.min_speedup,
                    verify_token_cost=p.verify_token_cost, min_verifies=p.min_verifies)
        if roles[p.pool] == "drafter" else
        PoolScaling(p.pool, roles[p.pool], SLOTargets(_seconds(p.slo_ttft_ms) if roles[p.pool] != "decode" else None,
                                                      _seconds(p.slo_tpot_ms) if roles[p.pool] != "prefill" else None),
                    _load(p, f"autoscaling.pools[{i}]", {}).capacity, p.min_replicas, p.max_replicas,
                    smoothing_s=p.smoothing_s, headroom=p.headroom,
                    fed_by=fed_by if roles[p.pool] == "decode" else None, max_standby=p.max_standby,
                    standby_cost=p.standby_cost)
        for i, p in enumerate(a.pools))
    try:
        return AutoscalerConfig(pools, horizon_s=a.horizon_s, up_cooldown_s=a.up_cooldown_s,
                                down_cooldown_s=a.down_cooldown_s, down_interval_s=a.down_interval_s,
                                short_window_s=a.short_window_s, scale_down=a.scale_down,
                                migration_s=a.migration_s, standby_memory_s=a.standby_memory_s,
                                scale_to_zero_after_s=a.scale_to_zero_after_s)
    except AutoscalerConfigError as e:
        raise ClusterConfigError(str(e).replace("autoscaler.", "autoscaling.", 1)) from None


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def _load(p: AutoscalePoolSection, key: str, s: Sources) -> Any:
    from cluster.autoscale.profile import ProfileError, load_profile

    try:
        return load_profile(Path(p.profile).expanduser())  # type: ignore[arg-type]
    except ProfileError as e:
        raise ClusterConfigError(f"{key}.profile={p.profile!r} ({source_of(f'{key}.profile', s)}): {e}") from None
