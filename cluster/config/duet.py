"""DuetConfig: the one configuration of a Duet deployment, from a YAML file, env and flags.

Layers, later wins:  built-in defaults  <  YAML file (``--config duet.yaml``)  <  environment
(``DUET_*``, ``RAY_ADDRESS``)  <  command-line flags. Every layer is a set of dotted keys
(``router.port``, ``pool.engine.block_size``); the merged result is validated once, here, and every
error names the key, the value, where the value came from, and what to change::

    >>> load_config(overrides={"router.port": "70000"}, env={})
    ClusterConfigError: router.port=70000 (from flag --port): must be in 0..65535 (0 picks a free port)

Sections (see ``cluster/duet.example.yaml`` for a documented file):
    model       what every worker serves: name or checkpoint path, dtype, max_model_len
    pools       worker pools, each sized and placed on its own; role colocated (each worker prefills
                and decodes), or a disaggregated pair of pools: prefill (computes prompts and sends
                their KV) + decode (streams tokens); see router/policies/disagg.py
    router      the public gRPC server and HTTP API: host, port, http_port, routing policy + options,
                admission limits
    ray         where the workers run: an existing cluster (``address``) or an embedded local one
    controller  how often membership and health are polled, how long a worker may take to start
    autoscaling the SLO autoscaler in ``duet serve``: per-pool SLOs, profiles, bounds, cadence
                (cluster/config/autoscale.py)

"The pool" (``pool.*`` keys) is ``pools[0]``: env and flags address it by that alias (so
``--replicas`` sizes the first pool; size the others in the YAML file).

One definition per setting: the model, engine, parallel, speculative and router keys are the
fields of workers.config and router.config types (cluster/config/derive.py), validated by those
types' own checks; this module adds what only a deployment has (pools, placement, Ray, the
controller) and the checks across sections (which pool roles, parallel sizes, quantization,
speculation and devices can work together; cluster/config/combinations.py).

This module imports neither torch nor ray (``duet --help`` and ``--dry-run`` stay fast).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- autoscaling section (cluster/config/autoscale.py) ----
from cluster.config.autoscale import (
    AutoscalePoolSection,
    AutoscalingSection,
    check_against_pools,
    check_autoscale_pool,
    check_autoscaling,
    to_autoscaler_config,
)
from cluster.config.derive import Part, check_derived, derived_section, keymap, owner_kwargs
from cluster.config.combinations import check_combinations
from cluster.config.sources import (
    ClusterConfigError,
    Sources,
    build,
    is_lower_config_error,
    lower_error,
    mark_sources,
    need,
    read_yaml,
    set_key,
)
from router.config import RouterConfig  # pure Python
from workers.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig  # no torch

__all__ = ["ClusterConfigError", "DuetConfig", "load_config"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
ROLES = ("colocated", "prefill", "decode")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


# ---------------------------------------------------------------------------------- sections
# model, pools[i].engine, the pools' parallel sizes and router are the worker and router config
# types' own fields under their YAML names (cluster/config/derive.py): their types, defaults and
# checks are defined once, there. pools[i].speculative *is* workers.config.SpeculativeConfig.
ModelSection = derived_section("ModelSection", """What every worker serves (workers.config.EngineConfig).
    name: 'SmolLM2-135M-Instruct' (embedded default) or a local HF checkpoint directory; each worker
    resolves it on its own node. dtype: auto | float32 | bfloat16 | float16 (auto: the checkpoint's
    torch_dtype on CUDA, float32 on CPU or when quantized). max_model_len: context limit
    (prompt + output); None = the model's, further capped by what one worker's KV pool holds.
    quantization: none | int8 | q4, weight-only quantization of the linear layers (needs float32).""", [
    ("name", Part(EngineConfig, "model")),
    ("dtype", Part(EngineConfig, "dtype")),
    ("max_model_len", Part(EngineConfig, "max_model_len")),
    ("quantization", Part(EngineConfig, "quantization")),
])

EngineSection = derived_section("EngineSection", """Per-worker engine settings (workers.config): tokens
    per KV block, the KV pool's byte budget (int or '64MiB' / '1GiB' / '500MB'), tokens per step,
    sequences per step (null = 64, or the token budget if smaller), prefix caching; fused_decode (the
    fused C++ decoder stack for decode steps) and cpu_kernels (the C++ CPU kernels; false = torch
    references), both on by default, for A/B runs [DUET_FUSED_DECODE=0, DUET_DISABLE_CPU_KERNELS=1];
    device: auto | cpu | cuda (auto: cuda when the pool reserves GPUs with gpus_per_rank and the node
    has CUDA, else cpu; workers/engine/device.py); cuda_graphs / cuda_graph_batch_sizes: decode steps
    replayed from CUDA graphs captured at these batch sizes (default 1, 2, 4, 8, multiples of 8 up to
    max_num_seqs; each <= max_num_seqs); kv_transfer_backend: how KV a worker receives from a peer
    (disaggregated prefill, prefix pull) travels: auto | shm | gloo | nccl (auto: shared memory from
    a same-host peer with the cache on the CPU, else nccl on CUDA, else gloo; workers/kv/transfer.py);
    target_itl_ms: null = the fixed max_num_batched_tokens per step, a number = prompt chunks sized
    so a step takes about that long (workers/engine/token_budget.py); omp_wait_policy: passive |
    active | runtime, how the worker's idle OpenMP threads wait, and niceness (0; null = Ray's 15):
    the worker process's thread settings (workers/server/threads.py).""", [
    ("block_size", Part(CacheConfig, "block_size")),
    ("kv_cache_memory_bytes", Part(CacheConfig, "kv_cache_memory_bytes")),
    ("max_num_batched_tokens", Part(SchedulerConfig, "max_num_batched_tokens")),
    ("max_num_seqs", Part(SchedulerConfig, "max_num_seqs")),
    ("target_itl_ms", Part(SchedulerConfig, "target_itl_ms")),
    ("enable_prefix_caching", Part(CacheConfig, "enable_prefix_caching")),
    ("fused_decode", Part(EngineConfig, "fused_decode")),
    ("cpu_kernels", Part(EngineConfig, "cpu_kernels")),
    ("device", Part(EngineConfig, "device")),
    ("cuda_graphs", Part(EngineConfig, "cuda_graphs")),
    ("cuda_graph_batch_sizes", Part(EngineConfig, "cuda_graph_batch_sizes")),
    ("kv_transfer_backend", Part(EngineConfig, "kv_transfer_backend")),
    ("omp_wait_policy", Part(EngineConfig, "omp_wait_policy")),
    ("niceness", Part(EngineConfig, "niceness")),
])


def _gang_size(self) -> int:
    return self.ep_size * self.sp_size * self.tp_size


def _parallel(self) -> ParallelConfig:
    """The gang's ``workers.config.ParallelConfig`` (what each rank of a replica joins)."""
    return ParallelConfig(**owner_kwargs(self, ParallelConfig))


PoolSection = derived_section("PoolSection", """One worker pool: ``replicas`` replicas, each a gang of
    ``gang_size`` ranks (Ray actors); each rank reserves one placement group bundle of
    ``cpus_per_replica`` CPUs, ``gpus_per_rank`` GPUs and ``resources_per_rank``. cpus_per_replica
    null (the default): an embedded Ray shares this machine's CPUs, less one for the router, among
    the ranks that leave it unset; with ray.address, 1 (cluster/deploy/cpu_share.py, said in the startup line). placement_strategy
    SPREAD (default) puts bundles on different nodes when it can, so losing a node loses one
    replica, not the pool; PACK fills one node first (fewer nodes to keep up); STRICT_* make that a
    hard requirement. max_restarts: how often Ray restarts a dead worker (-1 = forever).

    Parallelism (workers.config.ParallelConfig): each replica is a gang of ep_size * sp_size *
    tp_size ranks. ep_size holds a share of an MoE model's experts per rank; tp_size shards every
    layer (heads, MLP width, vocabulary); sp_size splits long prefill chunks over ranks (ring
    attention); 1 = off. comm: how same-host collectives travel (auto | shm | gloo) [DUET_COMM].

    Placement (cluster/deploy/pools.py): gpus_per_rank: GPUs per rank (a fraction below 1 shares a GPU).
    resources_per_rank: custom Ray resources per rank, e.g. {duet_pool_decode: 1} where only the
    decode pool's nodes offer it, so no rank lands on another pool's (or the drafters') nodes and an
    autoscaler adds the right ones.""", [
    ("name", (str, field(default="default"))),
    ("role", (str, field(default="colocated"))),
    ("replicas", (int, field(default=1))),
    ("cpus_per_replica", (int | None, field(default=None))),
    ("placement_strategy", (str, field(default="SPREAD"))),
    ("max_restarts", (int, field(default=-1))),
    ("engine", (EngineSection, field(default_factory=EngineSection))),
    ("ep_size", Part(ParallelConfig, "ep_size")),
    ("tp_size", Part(ParallelConfig, "tp_size")),
    ("sp_size", Part(ParallelConfig, "sp_size")),
    ("comm", Part(ParallelConfig, "comm")),
    ("speculative", (SpeculativeConfig, field(default_factory=SpeculativeConfig))),
    ("gpus_per_rank", (float, field(default=0.0))),
    ("resources_per_rank", (Mapping[str, float], field(default_factory=dict, hash=False))),
], namespace={"gang_size": property(_gang_size), "parallel": property(_parallel)})

RouterSection = derived_section("RouterSection", """The public gRPC server (``port``) and OpenAI-compatible
    HTTP API (``http_port``, 0 = off) (router.config.RouterConfig).
    policy: round_robin | least_loaded | prefix_aware, with its keyword options in policy_options.
    max_in_flight: requests streamed at once; max_queue: admitted requests waiting for a slot (beyond
    both: RESOURCE_EXHAUSTED). Security (router/security.py): tls_cert_file + tls_key_file (PEM)
    serve TLS only; tls_client_ca_file as well requires client certificates (mTLS); auth_tokens_file
    requires 'authorization: Bearer <token>' on every call but health checks; max_request_bytes
    bounds one request message (int or '4MiB'). disagg_min_prompt_tokens: with a prefill pool,
    prompts shorter than this run colocated on a decode worker. prefix_pull_min_tokens: a worker
    routed a prompt whose prefix of at least this many tokens another worker holds pulls that
    prefix's KV from it instead of recomputing it (0 = off; router/policies/prefix_pull.py). rebalance (off by
    default) and its thresholds: move running requests from the hottest to the coolest decode worker
    by live KV migration (router/rebalancer.py).""", [
    (name, Part(RouterConfig, name)) for name in (
        "host", "port", "http_port", "policy", "policy_options", "max_in_flight", "max_queue", "shutdown_grace_s",
        "tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file", "max_request_bytes",
        "disagg_min_prompt_tokens", "prefix_pull_min_tokens", "rebalance", "rebalance_interval_s", "rebalance_kv_gap",
        "rebalance_tpot_ratio", "rebalance_request_cooldown_s")
], probe={RouterConfig: {"tokenizer_path": "<model>"}})


@dataclass(frozen=True)
class RaySection:
    """address: None = start an embedded local Ray (stopped again on shutdown); 'auto' or
    'host:6379' = join an existing cluster (left running). num_cpus: CPUs the embedded Ray offers
    (None = all of this machine's). namespace: where the worker actors are named (``duet status``
    finds them there)."""

    address: str | None = None
    num_cpus: int | None = None
    namespace: str = "duet"


@dataclass(frozen=True)
class ControllerSection:
    """poll_interval_s: how often each worker actor is probed. start_timeout_s: how long a worker
    may take to load its engine and serve (serve fails if no worker is up by then).
    placement_timeout_s: with ray.address, how long ``duet serve`` waits for a pool's placement
    group (an autoscaler may still be adding nodes) before failing with what is missing (an
    embedded Ray cannot grow: a shortfall fails at once). host/port: where
    the controller serves duet.control.v1.Membership, the member list routers follow (0 = any free
    port; a router in another process or pod is started with ``--membership host:port``)."""

    poll_interval_s: float = 1.0
    start_timeout_s: float = 300.0
    placement_timeout_s: float = 60.0
    host: str = "127.0.0.1"
    port: int = 50052


@dataclass(frozen=True)
class DuetConfig:
    model: ModelSection = field(default_factory=ModelSection)
    pools: tuple[PoolSection, ...] = (PoolSection(),)
    router: RouterSection = field(default_factory=RouterSection)
    ray: RaySection = field(default_factory=RaySection)
    controller: ControllerSection = field(default_factory=ControllerSection)
    autoscaling: AutoscalingSection = field(default_factory=AutoscalingSection)

    @property
    def pool(self) -> PoolSection:
        """The first pool (what ``pool.*`` env keys and flags set)."""
        return self.pools[0]

    def to_engine_config(self, pool: PoolSection | None = None) -> EngineConfig:
        """The ``workers.config.EngineConfig`` every worker of ``pool`` (default: the pool) runs."""
        pool = pool or self.pool
        e = pool.engine
        return EngineConfig(**owner_kwargs(self.model, EngineConfig), **owner_kwargs(e, EngineConfig),
                            cache=CacheConfig(**owner_kwargs(e, CacheConfig)),
                            scheduler=SchedulerConfig(**owner_kwargs(e, SchedulerConfig)),
                            speculative=pool.speculative)

    def to_router_config(self, tokenizer_path: str, max_model_len: int | None = None, **extra: Any) -> RouterConfig:
        """The ``router.config.RouterConfig``. tokenizer_path: the resolved checkpoint directory;
        max_model_len: the workers' effective limit (default: ``model.max_model_len``); extra:
        further RouterConfig fields (tests shorten poll intervals)."""
        return RouterConfig(
            tokenizer_path=tokenizer_path, model_name=Path(self.model.name).name,
            max_model_len=max_model_len if max_model_len is not None else self.model.max_model_len,
            **owner_kwargs(self.router, RouterConfig), disagg_block_size=self.pool.engine.block_size, **extra)

    def to_autoscaler_config(self):
        """The ``cluster.autoscale.slo.AutoscalerConfig`` of the ``autoscaling`` section."""
        return to_autoscaler_config(self.autoscaling, {p.name: p.role for p in self.pools})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``duet serve --dry-run`` prints as YAML)."""
        def plain(v: Any) -> Any:
            if dataclasses.is_dataclass(v):
                return {f.name: plain(_yaml_shape(f, getattr(v, f.name))) for f in dataclasses.fields(v)}
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            if isinstance(v, Mapping):
                return {k: plain(x) for k, x in v.items()}
            return v
        return plain(self)


def _yaml_shape(f: dataclasses.Field, value: Any) -> Any:
    """A field's value as YAML writes it: resource amounts (tuple[tuple[str, float], ...]) as a mapping."""
    return dict(value) if f.type in ("tuple[tuple[str, float], ...]", tuple[tuple[str, float], ...]) else value


# ---------------------------------------------------------------------------------- sources
# Environment variables -> dotted keys. RAY_ADDRESS is Ray's own convention.
ENV_KEYS: dict[str, str] = {
    "DUET_MODEL": "model.name",
    "DUET_DTYPE": "model.dtype",
    "DUET_MAX_MODEL_LEN": "model.max_model_len",
    "DUET_QUANTIZATION": "model.quantization",
    "DUET_REPLICAS": "pool.replicas",
    "DUET_CPUS_PER_REPLICA": "pool.cpus_per_replica",
    "DUET_KV_CACHE_MEMORY": "pool.engine.kv_cache_memory_bytes",
    "DUET_DEVICE": "pool.engine.device",
    "DUET_GPUS_PER_RANK": "pool.gpus_per_rank",
    "DUET_CUDA_GRAPHS": "pool.engine.cuda_graphs",
    "DUET_DRAFTER_DEVICE": "pool.speculative.drafter_device",
    "DUET_HOST": "router.host",
    "DUET_PORT": "router.port",
    "DUET_HTTP_PORT": "router.http_port",
    "DUET_POLICY": "router.policy",
    "DUET_TLS_CERT_FILE": "router.tls_cert_file",
    "DUET_TLS_KEY_FILE": "router.tls_key_file",
    "DUET_TLS_CLIENT_CA_FILE": "router.tls_client_ca_file",
    "DUET_AUTH_TOKENS_FILE": "router.auth_tokens_file",
    "DUET_CONTROLLER_PORT": "controller.port",
    "RAY_ADDRESS": "ray.address",
    "DUET_RAY_NUM_CPUS": "ray.num_cpus",
}
# Switches that apply to every pool: env var -> (key under pools[i], value parser). The library reads
# none of them; they reach the workers through their EngineConfig / ParallelConfig.
POOL_ENV_KEYS: dict[str, tuple[str, Callable[[str], str]]] = {
    "DUET_FUSED_DECODE": ("engine.fused_decode", str),  # 0 = off (A/B runs)
    "DUET_DISABLE_CPU_KERNELS": ("engine.cpu_kernels", lambda v: _negate(v, "DUET_DISABLE_CPU_KERNELS")),
    "DUET_COMM": ("comm", str),  # auto | shm | gloo
}
CONFIG_ENV = "DUET_CONFIG"  # a YAML file used when --config is not given


def _negate(value: str, var: str) -> str:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return "false"
    if text in ("0", "false", "no", "off"):
        return "true"
    raise ClusterConfigError(f"env {var}={value!r}: must be 1 (true) or 0 (false)")


def load_config(path: str | os.PathLike[str] | None = None, *, overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, flag_names: Mapping[str, str] | None = None,
                sources: Sources | None = None) -> DuetConfig:
    """Merge defaults < YAML file < env < overrides and validate once.

    path: YAML file (None: ``$DUET_CONFIG`` if set, else no file). overrides: dotted key -> value
    (strings are parsed like env values; None values are ignored) — the CLI's flags. env: the
    environment (default ``os.environ``). flag_names: dotted key -> flag spelling, for messages.
    sources: filled with dotted key -> where its value came from (for later checks' messages).
    """
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    sources = {} if sources is None else sources
    path = path if path is not None else env.get(CONFIG_ENV) or None
    if path is not None:
        raw = read_yaml(Path(path))
        mark_sources(raw, "", f"{path}", sources)
    for var, key in ENV_KEYS.items():
        value = env.get(var)
        if value not in (None, ""):
            set_key(raw, key, value, sources, f"env {var}")
    pools = raw.get("pools")
    for var, (key, parse) in POOL_ENV_KEYS.items():
        value = env.get(var)
        if value not in (None, ""):
            for i in range(len(pools) if isinstance(pools, list) and pools else 1):
                set_key(raw, f"pools[{i}].{key}", parse(value), sources, f"env {var}")
    flag_names = flag_names or {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_key(raw, key, value, sources, f"flag {flag_names.get(key, key)}")
    return build(DuetConfig, raw, "", sources, _CHECKS)


def _check_pool(pool: PoolSection, p: str, s: Sources) -> None:
    need(bool(_NAME_RE.match(pool.name)), f"{p}.name", pool.name, s,
         "must be lower-case letters, digits and '_', starting with a letter (it names the actors)")
    need(pool.role in ROLES, f"{p}.role", pool.role, s,
         f"must be one of {', '.join(ROLES)} (prefill + decode pools make a disaggregated deployment)")
    need(pool.replicas >= 1, f"{p}.replicas", pool.replicas, s, "must be >= 1")
    need(pool.cpus_per_replica is None or pool.cpus_per_replica >= 1, f"{p}.cpus_per_replica",
         pool.cpus_per_replica, s, "must be >= 1 (it is also the worker's torch thread count), or null to use "
         "what the machine offers")
    need(pool.placement_strategy in PLACEMENT_STRATEGIES, f"{p}.placement_strategy", pool.placement_strategy, s,
         f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")
    need(pool.max_restarts >= -1, f"{p}.max_restarts", pool.max_restarts, s, "must be -1 (forever) or >= 0")
    check_derived(pool, p, s)  # ep_size, tp_size, sp_size, comm: ParallelConfig's checks
    _check_placement_resources(pool, p, s)


def _check_placement_resources(pool: PoolSection, p: str, s: Sources) -> None:
    """gpus_per_rank and resources_per_rank in the shapes Ray accepts for a bundle and an actor."""
    g = pool.gpus_per_rank
    need(g >= 0 and (g <= 1 or g.is_integer()), f"{p}.gpus_per_rank", g, s,
         "must be >= 0: a whole number of GPUs, or a fraction below 1 to share one GPU")
    for name, amount in pool.resources_per_rank.items():
        key = f"{p}.resources_per_rank"
        need(isinstance(name, str) and bool(name.strip()), key, dict(pool.resources_per_rank), s,
             "must map Ray resource names to amounts, e.g. {duet_pool_decode: 1}")
        need(name not in ("CPU", "GPU"), key, dict(pool.resources_per_rank), s,
             f"{name} has its own key: set cpus_per_replica / gpus_per_rank instead")
        need(isinstance(amount, (int, float)) and not isinstance(amount, bool) and 0 < amount < float("inf"),
             key, dict(pool.resources_per_rank), s, f"{name}: amounts must be numbers > 0")


def _check_router(r: RouterSection, p: str, s: Sources) -> None:
    # Files are checked here, at the edge, where they are read; everything else is RouterConfig's.
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
        path = getattr(r, name)
        need(path is None or Path(path).expanduser().is_file(), f"{p}.{name}", path, s,
             "must be a readable file (PEM for TLS; see router/security.py for the tokens file)")
    check_derived(r, p, s)


def _check_ray(r: RaySection, p: str, s: Sources) -> None:
    need(r.address is None or bool(r.address.strip()), f"{p}.address", r.address, s,
         "must be 'auto', 'host:port' or 'ray://host:port', or null for an embedded local Ray")
    need(r.num_cpus is None or r.num_cpus >= 1, f"{p}.num_cpus", r.num_cpus, s, "must be >= 1 or null (all CPUs)")
    need(r.num_cpus is None or r.address is None, f"{p}.num_cpus", r.num_cpus, s,
         f"only applies to an embedded Ray; unset it or unset ray.address ({r.address!r})")
    need(bool(r.namespace), f"{p}.namespace", r.namespace, s, "must be a non-empty name")


def _check_controller(c: ControllerSection, p: str, s: Sources) -> None:
    need(c.poll_interval_s > 0, f"{p}.poll_interval_s", c.poll_interval_s, s, "must be > 0 seconds")
    need(c.start_timeout_s > 0, f"{p}.start_timeout_s", c.start_timeout_s, s, "must be > 0 seconds")
    need(c.placement_timeout_s > 0, f"{p}.placement_timeout_s", c.placement_timeout_s, s, "must be > 0 seconds")
    need(bool(c.host), f"{p}.host", c.host, s, "must be a host or address, e.g. 127.0.0.1 or 0.0.0.0")
    need(0 <= c.port <= 65535, f"{p}.port", c.port, s, "must be in 0..65535 (0 picks a free port)")


def _check_duet(c: DuetConfig, p: str, s: Sources) -> None:
    names = [pool.name for pool in c.pools]
    need(len(c.pools) >= 1, "pools", names, s, "must hold at least one pool")
    need(len(set(names)) == len(names), "pools", names, s, "pool names must be unique (they name the actors)")
    roles = {pool.role for pool in c.pools}
    need(bool(roles & {"colocated", "decode"}), "pools", names, s,
         "needs a colocated or decode pool to stream tokens (a prefill pool only computes prompts)")
    sizes = {pool.engine.block_size for pool in c.pools}
    need(len(sizes) == 1, "pools", names, s,
         f"every pool must use the same engine.block_size (KV blocks move between them), got {sorted(sizes)}")
    for i, pool in enumerate(c.pools):
        _check_engine_config(c, i, s)
    check_combinations(c, s)
    check_against_pools(c.autoscaling, {pool.name: pool.role for pool in c.pools},
                        {pool.name: pool.replicas for pool in c.pools}, s)


def _check_engine_config(c: DuetConfig, i: int, s: Sources) -> None:
    """Build pool i's EngineConfig: the engine's checks across model, engine and speculative keys."""
    pool = c.pools[i]
    try:
        c.to_engine_config(pool)
    except ValueError as e:
        if not is_lower_config_error(e):
            raise
        keys = {**keymap(c.model, "model"), **keymap(pool.engine, f"pools[{i}].engine")}
        keys.update({f"speculative.{f.name}": (f"pools[{i}].speculative.{f.name}", getattr(pool.speculative, f.name))
                     for f in dataclasses.fields(SpeculativeConfig)})
        raise lower_error(e, keys, s) from None


_CHECKS = {ModelSection: check_derived, EngineSection: check_derived, PoolSection: _check_pool,
           RouterSection: _check_router, RaySection: _check_ray, ControllerSection: _check_controller,
           DuetConfig: _check_duet, AutoscalingSection: check_autoscaling, AutoscalePoolSection: check_autoscale_pool}

