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
    router      the public gRPC server: host, port, routing policy + options, admission limits
    ray         where the workers run: an existing cluster (``address``) or an embedded local one
    controller  how often membership and health are polled, how long a worker may take to start
    autoscaling the SLO autoscaler in ``duet serve``: per-pool SLOs, profiles, bounds, cadence
                (cluster/autoscale_config.py)

"The pool" (``pool.*`` keys) is ``pools[0]``: env and flags address it by that alias (so
``--replicas`` sizes the first pool; size the others in the YAML file).

This module imports neither torch nor ray (``duet --help`` stays fast); ``to_engine_config`` and
``to_router_config`` import the engine and router configs when called.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- autoscaling section (cluster/autoscale_config.py) ----
from cluster.autoscale_config import (
    AutoscalePoolSection,
    AutoscalingSection,
    check_against_pools,
    check_autoscale_pool,
    check_autoscaling,
    to_autoscaler_config,
)
from cluster.config_sources import (
    ClusterConfigError,
    Sources,
    build,
    mark_sources,
    need,
    read_yaml,
    set_key,
    source_of,
)

__all__ = ["ClusterConfigError", "DuetConfig", "load_config"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
ROLES = ("colocated", "prefill", "decode")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


# ---------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ModelSection:
    """name: 'SmolLM2-135M-Instruct' (embedded default) or a local HF checkpoint directory; each
    worker resolves it on its own node. dtype: auto (the checkpoint's where the device supports it,
    float32 on CPU) | float32 | bfloat16 | float16. max_model_len: context
    limit (prompt + output); None = the model's, further capped by what one worker's KV pool holds.
    quantization: none | int8 | q4, weight-only quantization of the linear layers (needs float32)."""

    name: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    quantization: str = "none"


@dataclass(frozen=True)
class EngineSection:
    """Per-worker engine settings (see workers.config): tokens per KV block, the KV pool's byte
    budget (int or '64MiB' / '1GiB' / '500MB'), tokens per step, sequences per step."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SpeculativeSection:
    """Speculative decoding for a colocated or decode pool (see workers.config.SpeculativeConfig):
    method none | ngram | draft_model; num_speculative_tokens (most drafts per step); adaptive
    draft length; ngram_min/ngram_max; draft_model (checkpoint or model name sharing the target's
    tokenizer) and draft_quantization; drafter_cpus and drafter_resources (Ray resources the
    drafter actor requests, e.g. {drafter: 1} to land on CPU drafter nodes); draft_timeout_s
    (a slower drafter is dropped for the request, which continues without speculation); overlap
    (draft the next window while the target verifies); draft_vocab_size (the drafter scores only
    its tokenizer's most frequent tokens; 0 = all); drafter_threads (0 = drafter_cpus)."""

    method: str = "none"
    num_speculative_tokens: int = 4
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_quantization: str = "none"
    drafter_cpus: int = 1
    drafter_resources: Mapping[str, float] = field(default_factory=dict, hash=False)
    draft_timeout_s: float = 2.0
    overlap: bool = True
    draft_vocab_size: int = 0
    drafter_threads: int = 0


@dataclass(frozen=True)
class PoolSection:
    """One worker pool: ``replicas`` replicas, each a gang of ``gang_size`` ranks (Ray actors); each
    rank reserves one placement group bundle of ``cpus_per_replica`` CPUs, ``gpus_per_rank`` GPUs
    and ``resources_per_rank``. placement_strategy SPREAD (default) puts bundles on different nodes
    when it can, so losing a node loses one replica, not the pool; PACK fills one node first
    (fewer nodes to keep up); STRICT_* make that a hard requirement. max_restarts: how often Ray
    restarts a dead worker (-1 = forever)."""

    name: str = "default"
    role: str = "colocated"
    replicas: int = 1
    cpus_per_replica: int = 1
    placement_strategy: str = "SPREAD"
    max_restarts: int = -1
    engine: EngineSection = field(default_factory=EngineSection)
    # MoE: each replica is a gang of ep_size ranks (Ray actors, one bundle each) holding a share of
    # the experts, serving as one worker (workers/parallel/gang_actor.py). 1 = a plain worker.
    ep_size: int = 1
    # Tensor / sequence parallelism: each replica is a gang of ep_size * sp_size * tp_size ranks.
    # tp_size shards every layer (heads, MLP width, vocabulary); sp_size splits long prefill chunks
    # over ranks (ring attention). 1 = off.
    tp_size: int = 1
    sp_size: int = 1
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    # Placement (cluster/pools.py): what each rank's bundle and actor reserve besides its CPUs.
    # gpus_per_rank: GPUs per rank (a fraction below 1 shares a GPU). resources_per_rank: custom Ray
    # resources per rank, e.g. {duet_pool_decode: 1} where only the decode pool's nodes offer it,
    # so no rank lands on another pool's (or the drafters') nodes and an autoscaler adds the right ones.
    gpus_per_rank: float = 0.0
    resources_per_rank: Mapping[str, float] = field(default_factory=dict, hash=False)

    @property
    def gang_size(self) -> int:
        return self.ep_size * self.sp_size * self.tp_size


@dataclass(frozen=True)
class RouterSection:
    """The public gRPC server. policy: round_robin | least_loaded | prefix_aware, with its keyword
    options in policy_options. max_in_flight: requests streamed at once; max_queue: admitted
    requests waiting for a slot (beyond both: RESOURCE_EXHAUSTED). Security (router/security.py):
    tls_cert_file + tls_key_file (PEM) serve TLS only; tls_client_ca_file as well requires client
    certificates (mTLS); auth_tokens_file requires 'authorization: Bearer <token>' on every call but
    health checks; max_request_bytes bounds one request message (int or '4MiB')."""

    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "prefix_aware"
    policy_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    max_in_flight: int = 128
    max_queue: int = 512
    shutdown_grace_s: float = 5.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    auth_tokens_file: str | None = None
    max_request_bytes: int = 4 << 20
    # With a prefill pool: prompts shorter than this many tokens run colocated on a decode worker.
    disagg_min_prompt_tokens: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy_options", types.MappingProxyType(dict(self.policy_options)))


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
    may take to load its engine and serve (serve fails if no worker is up by then). host/port: where
    the controller serves duet.control.v1.Membership, the member list routers follow (0 = any free
    port; a router in another process or pod is started with ``--membership host:port``)."""

    poll_interval_s: float = 1.0
    start_timeout_s: float = 300.0
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

    def to_engine_config(self, pool: PoolSection | None = None):
        """The ``workers.config.EngineConfig`` every worker of ``pool`` (default: the pool) runs."""
        from workers.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig

        pool = pool or self.pool
        e, sp = pool.engine, pool.speculative
        return EngineConfig(
            model=self.model.name, dtype=self.model.dtype, max_model_len=self.model.max_model_len,
            quantization=self.model.quantization,
            cache=CacheConfig(block_size=e.block_size, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
                              enable_prefix_caching=e.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs),
            speculative=SpeculativeConfig(**dataclasses.asdict(sp)),  # the same fields, one per layer
        )

    def to_router_config(self, tokenizer_path: str, max_model_len: int | None = None, **extra: Any):
        """The ``router.config.RouterConfig``. tokenizer_path: the resolved checkpoint directory;
        max_model_len: the workers' effective limit (default: ``model.max_model_len``); extra:
        further RouterConfig fields (tests shorten poll intervals)."""
        from router.config import RouterConfig

        r = self.router
        return RouterConfig(
            tokenizer_path=tokenizer_path, model_name=Path(self.model.name).name,
            max_model_len=max_model_len if max_model_len is not None else self.model.max_model_len,
            host=r.host, port=r.port, policy=r.policy, policy_options=dict(r.policy_options),
            max_in_flight=r.max_in_flight, max_queue=r.max_queue, shutdown_grace_s=r.shutdown_grace_s,
            tls_cert_file=r.tls_cert_file, tls_key_file=r.tls_key_file, tls_client_ca_file=r.tls_client_ca_file,
            auth_tokens_file=r.auth_tokens_file, max_request_bytes=r.max_request_bytes,
            disagg_min_prompt_tokens=r.disagg_min_prompt_tokens, disagg_block_size=self.pool.engine.block_size, **extra)

    def to_autoscaler_config(self):
        """The ``cluster.autoscaler.AutoscalerConfig`` of the ``autoscaling`` section."""
        return to_autoscaler_config(self.autoscaling, {p.name: p.role for p in self.pools})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``duet serve --dry-run`` prints as YAML)."""
        def plain(v: Any) -> Any:
            if dataclasses.is_dataclass(v):
                return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            if isinstance(v, Mapping):
                return {k: plain(x) for k, x in v.items()}
            return v
        return plain(self)


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
    "DUET_HOST": "router.host",
    "DUET_PORT": "router.port",
    "DUET_POLICY": "router.policy",
    "DUET_TLS_CERT_FILE": "router.tls_cert_file",
    "DUET_TLS_KEY_FILE": "router.tls_key_file",
    "DUET_TLS_CLIENT_CA_FILE": "router.tls_client_ca_file",
    "DUET_AUTH_TOKENS_FILE": "router.auth_tokens_file",
    "DUET_CONTROLLER_PORT": "controller.port",
    "RAY_ADDRESS": "ray.address",
    "DUET_RAY_NUM_CPUS": "ray.num_cpus",
}
CONFIG_ENV = "DUET_CONFIG"  # a YAML file used when --config is not given


def load_config(path: str | os.PathLike[str] | None = None, *, overrides: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, flag_names: Mapping[str, str] | None = None) -> DuetConfig:
    """Merge defaults < YAML file < env < overrides and validate once.

    path: YAML file (None: ``$DUET_CONFIG`` if set, else no file). overrides: dotted key -> value
    (strings are parsed like env values; None values are ignored) — the CLI's flags. env: the
    environment (default ``os.environ``). flag_names: dotted key -> flag spelling, for messages.
    """
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    sources: Sources = {}
    path = path if path is not None else env.get(CONFIG_ENV) or None
    if path is not None:
        raw = read_yaml(Path(path))
        mark_sources(raw, "", f"{path}", sources)
    for var, key in ENV_KEYS.items():
        value = env.get(var)
        if value not in (None, ""):
            set_key(raw, key, value, sources, f"env {var}")
    flag_names = flag_names or {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_key(raw, key, value, sources, f"flag {flag_names.get(key, key)}")
    return build(DuetConfig, raw, "", sources, _CHECKS)


def _check_model(m: ModelSection, p: str, s: Sources) -> None:
    need(bool(m.name.strip()), f"{p}.name", m.name, s, f"must name a model ({DEFAULT_MODEL!r}) or a checkpoint dir")
    need(m.dtype in ("auto", "float32", "bfloat16", "float16"), f"{p}.dtype", m.dtype, s,
         "must be one of auto, float32, bfloat16, float16")
    need(m.max_model_len is None or m.max_model_len >= 2, f"{p}.max_model_len", m.max_model_len, s,
         "must be >= 2, or null for the model's own limit")
    need(m.quantization in ("none", "int8", "q4"), f"{p}.quantization", m.quantization, s,
         "must be one of none, int8, q4")
    need(m.quantization == "none" or m.dtype in ("auto", "float32"), f"{p}.quantization", m.quantization, s,
         f"quantized weights run with float32 activations; set model.dtype to float32 (it is {m.dtype})")


def _check_engine(e: EngineSection, p: str, s: Sources) -> None:
    need(e.block_size >= 1 and not e.block_size & (e.block_size - 1), f"{p}.block_size", e.block_size, s,
         "must be a power of two (16 is a good default)")
    need(e.kv_cache_memory_bytes >= 1 << 20, f"{p}.kv_cache_memory_bytes", e.kv_cache_memory_bytes, s,
         "must be at least 1MiB (e.g. 64MiB, 1GiB)")
    need(e.max_num_batched_tokens >= 1, f"{p}.max_num_batched_tokens", e.max_num_batched_tokens, s, "must be >= 1")
    need(1 <= e.max_num_seqs <= e.max_num_batched_tokens, f"{p}.max_num_seqs", e.max_num_seqs, s,
         f"must be between 1 and max_num_batched_tokens ({e.max_num_batched_tokens})")


def _check_pool(pool: PoolSection, p: str, s: Sources) -> None:
    need(bool(_NAME_RE.match(pool.name)), f"{p}.name", pool.name, s,
         "must be lower-case letters, digits and '_', starting with a letter (it names the actors)")
    need(pool.role in ROLES, f"{p}.role", pool.role, s,
         f"must be one of {', '.join(ROLES)} (prefill + decode pools make a disaggregated deployment)")
    need(pool.speculative.method == "none" or pool.role != "prefill", f"{p}.speculative.method",
         pool.speculative.method, s, "a prefill pool produces one token per request; speculate on the decode pool")
    need(pool.replicas >= 1, f"{p}.replicas", pool.replicas, s, "must be >= 1")
    need(pool.cpus_per_replica >= 1, f"{p}.cpus_per_replica", pool.cpus_per_replica, s,
         "must be >= 1 (it is also the worker's torch thread count)")
    need(pool.placement_strategy in PLACEMENT_STRATEGIES, f"{p}.placement_strategy", pool.placement_strategy, s,
         f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")
    need(pool.max_restarts >= -1, f"{p}.max_restarts", pool.max_restarts, s, "must be -1 (forever) or >= 0")
    need(pool.ep_size >= 1, f"{p}.ep_size", pool.ep_size, s,
         "must be >= 1 (ranks per expert-parallel gang; it must divide the model's experts)")
    need(pool.tp_size >= 1, f"{p}.tp_size", pool.tp_size, s,
         "must be >= 1 (tensor-parallel ranks per replica; at most the model's kv heads, or a multiple of them "
         "that divides the query heads)")
    need(pool.sp_size >= 1, f"{p}.sp_size", pool.sp_size, s,
         "must be >= 1 (sequence-parallel ranks per replica, splitting long prefill chunks)")
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


def _check_speculative(sp: SpeculativeSection, p: str, s: Sources) -> None:
    need(sp.method in ("none", "ngram", "draft_model"), f"{p}.method", sp.method, s,
         "must be one of none, ngram (prompt lookup, no model), draft_model (a small LM in its own actor)")
    need(1 <= sp.num_speculative_tokens <= 16, f"{p}.num_speculative_tokens", sp.num_speculative_tokens, s,
         "must be in 1..16 (the most tokens drafted per step; 4 is a good default)")
    need(1 <= sp.ngram_min <= sp.ngram_max, f"{p}.ngram_min", sp.ngram_min, s,
         f"need 1 <= ngram_min <= ngram_max ({sp.ngram_max})")
    need(sp.method != "draft_model" or bool(sp.draft_model), f"{p}.draft_model", sp.draft_model, s,
         "method draft_model needs a drafter: a checkpoint dir or model name with the target's tokenizer")
    need(sp.draft_quantization in ("none", "int8", "q4"), f"{p}.draft_quantization", sp.draft_quantization, s,
         "must be one of none, int8, q4")
    need(sp.drafter_cpus >= 1, f"{p}.drafter_cpus", sp.drafter_cpus, s, "must be >= 1")
    need(all(isinstance(v, (int, float)) and v > 0 for v in sp.drafter_resources.values()),
         f"{p}.drafter_resources", dict(sp.drafter_resources), s,
         "must map Ray resource names to amounts > 0, e.g. {drafter: 1}")
    need(sp.draft_timeout_s > 0, f"{p}.draft_timeout_s", sp.draft_timeout_s, s, "must be > 0 seconds")
    need(sp.draft_vocab_size == 0 or sp.draft_vocab_size >= 256, f"{p}.draft_vocab_size",
         sp.draft_vocab_size, s, "must be 0 (the drafter's full vocabulary) or >= 256, e.g. 32768")
    need(sp.drafter_threads >= 0, f"{p}.drafter_threads", sp.drafter_threads, s, "must be >= 0 (0 = drafter_cpus)")


def _check_router(r: RouterSection, p: str, s: Sources) -> None:
    need(bool(r.host), f"{p}.host", r.host, s, "must be a host or address, e.g. 127.0.0.1 or 0.0.0.0")
    need(0 <= r.port <= 65535, f"{p}.port", r.port, s, "must be in 0..65535 (0 picks a free port)")
    from router.policies import PolicyConfigError, make_policy  # pure Python, no torch

    try:
        make_policy(r.policy, **r.policy_options)
    except PolicyConfigError as e:
        key = f"{p}.policy" if str(e).startswith("unknown routing policy") else f"{p}.policy_options"
        value = r.policy if key.endswith(".policy") else dict(r.policy_options)
        raise ClusterConfigError(f"{key}={value!r} ({source_of(key, s)}): {e}") from None
    need(r.max_in_flight >= 1, f"{p}.max_in_flight", r.max_in_flight, s, "must be >= 1")
    need(r.max_queue >= 0, f"{p}.max_queue", r.max_queue, s, "must be >= 0 (0 = reject when all slots are busy)")
    need(r.shutdown_grace_s >= 0, f"{p}.shutdown_grace_s", r.shutdown_grace_s, s, "must be >= 0 seconds")
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
        path = getattr(r, name)
        need(path is None or Path(path).expanduser().is_file(), f"{p}.{name}", path, s,
             "must be a readable file (PEM for TLS; see router/security.py for the tokens file)")
    need((r.tls_cert_file is None) == (r.tls_key_file is None), f"{p}.tls_key_file", r.tls_key_file, s,
         "TLS needs both router.tls_cert_file and router.tls_key_file; set both or neither")
    need(r.tls_client_ca_file is None or r.tls_cert_file is not None, f"{p}.tls_client_ca_file",
         r.tls_client_ca_file, s, "client certificates (mTLS) need TLS: set router.tls_cert_file and tls_key_file")
    need(r.max_request_bytes >= 1024, f"{p}.max_request_bytes", r.max_request_bytes, s, "must be at least 1024")
    need(r.disagg_min_prompt_tokens >= 0, f"{p}.disagg_min_prompt_tokens", r.disagg_min_prompt_tokens, s,
         "must be >= 0 (0 = disaggregate every request)")


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
    check_against_pools(c.autoscaling, {pool.name: pool.role for pool in c.pools},
                        {pool.name: pool.replicas for pool in c.pools}, s)


_CHECKS = {ModelSection: _check_model, SpeculativeSection: _check_speculative, EngineSection: _check_engine, PoolSection: _check_pool,
           RouterSection: _check_router, RaySection: _check_ray, ControllerSection: _check_controller,
           DuetConfig: _check_duet, AutoscalingSection: check_autoscaling, AutoscalePoolSection: check_autoscale_pool}
