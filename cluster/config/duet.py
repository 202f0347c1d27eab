"""DuetConfig: the one configuration of a Duet deployment, from a YAML file, env and flags.

Layers, later wins:  built-in defaults  <  YAML file (``--config duet.yaml``)  <  environment
(``DUET_*``, ``RAY_ADDRESS``)  <  command-line flags. Every layer is plain data addressed by dotted
keys (``router.port``, ``pool.engine.block_size``; cluster/config/sources.py); the merged result is
validated once, here (pydantic for each value, then the checks across keys), and every error names
the key, the value, where the value came from, and what to change::

    >>> load_config(overrides={"router.port": "70000"}, flag_names={"router.port": "--port"}, env={})
    ClusterConfigError: router.port=70000 (from flag --port): must be in 0..65535 (0 picks a free port)

Sections (see ``cluster/duet.example.yaml`` for a documented file, docs/reference/settings.md for
every key with its env var and flag):
    model       what every worker serves: name or checkpoint path, dtype, max_model_len, LoRA adapters
    models      several models in one deployment instead (each a ``model`` section, plus
                served_name); each pool names the one it serves (``pools[i].model``), requests
                select one by name (router/catalog.py); the first is the default
    pools       worker pools, each sized and placed on its own; role colocated (each worker prefills
                and decodes), or a disaggregated pair of pools: prefill (computes prompts and sends
                their KV) + decode (streams tokens); see router/policies/disagg.py; or drafter (replicas
                of a draft model that colocated / decode pools name in speculative.drafter_pool: the
                router hands each speculative request one of them; workers/spec_decode/)
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
controller), each key's env var and flag (``SWITCHES``), and the checks across sections (which pool
roles, parallel sizes, quantization, speculation and devices can work together;
cluster/config/combinations.py).

This module imports neither torch nor ray (``duet --help`` and ``--dry-run`` stay fast).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError
from pydantic.json_schema import JsonDict

from cluster.config.autoscale import AutoscalingSection, check_against_pools, check_autoscaling, to_autoscaler_config
from cluster.config.combinations import check_combinations
from cluster.config.derive import (AutoByteCount, ByteCount, DerivedSection, Part, Section, check_derived, derived_section, keymap,
                                   owner_kwargs)
from cluster.config.sources import (
    ClusterConfigError,
    KeySource,
    Sources,
    is_lower_config_error,
    lower_error,
    mark_sources,
    merge,
    need,
    read_yaml,
    validation_error,
)
from router.config import AdapterSpec, ModelSpec, RouterConfig  # pure Python
from workers.config import (  # no torch
    CacheConfig,
    DrafterConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

__all__ = ["ClusterConfigError", "DuetConfig", "load_config"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
ROLES = ("colocated", "prefill", "decode", "drafter")


# ---------------------------------------------------------------------------------- sections
# model, pools[i].engine, the pools' parallel sizes and router are the worker and router config
# types' own fields under their YAML names (cluster/config/derive.py): their types, defaults, checks
# and descriptions are defined once, there. pools[i].speculative *is* workers.config.SpeculativeConfig,
# and pools[i].drafter (role drafter) *is* workers.config.DrafterConfig.
class _Model(DerivedSection):
    @property
    def served(self) -> str:
        """The name requests select it by (``served_name``, else the last component of ``name``)."""
        return self.served_name or Path(self.name).name


@derived_section([
    ("name", Part(AdapterSpec, "name")),
    ("source", Part(AdapterSpec, "source")),
    ("pinned", Part(AdapterSpec, "pinned")),
])
class AdapterSection(DerivedSection):
    """A LoRA adapter of a model (router.config.AdapterSpec): requests name it alone or as
    ``<model>:<name>``; workers load it from ``source`` on first use."""


@derived_section([
    ("name", Part(EngineConfig, "model")),
    ("served_name", (str | None, Field(None, description="The name requests select the model by "
                     "(GenerateRequest.model, HTTP `model`); null = the last path component of name.",
                     json_schema_extra={"hint": "must be a non-empty name without ':' (or null)"}))),
    ("dtype", Part(EngineConfig, "dtype")),
    ("max_model_len", Part(EngineConfig, "max_model_len")),
    ("quantization", Part(EngineConfig, "quantization")),
    ("shared_weights_dir", Part(EngineConfig, "shared_weights_dir")),
    ("adapters", (tuple[AdapterSection, ...], Field((), description="LoRA adapters of this model (PEFT "
                  "directories: adapter_config.json + adapter_model.safetensors), each {name, source, pinned}; "
                  "more can be loaded at runtime (POST /v1/load_lora_adapter)."))),
    ("adapter_dir", Part(ModelSpec, "adapter_dir")),
], probe={ModelSpec: {"name": "probe", "tokenizer_path": "probe"}})
class ModelSection(_Model):
    """A model the workers serve (workers.config.EngineConfig) and its LoRA adapters."""


@derived_section([
    ("block_size", Part(CacheConfig, "block_size")),
    ("kv_cache_memory_bytes", Part(CacheConfig, "kv_cache_memory_bytes", type=ByteCount)),
    ("max_num_batched_tokens", Part(SchedulerConfig, "max_num_batched_tokens")),
    ("max_num_seqs", Part(SchedulerConfig, "max_num_seqs")),
    ("target_itl_ms", Part(SchedulerConfig, "target_itl_ms")),
    ("enable_prefix_caching", Part(CacheConfig, "enable_prefix_caching")),
    ("host_tier_bytes", Part(CacheConfig, "host_tier_bytes", type=AutoByteCount)),
    ("disk_tier_bytes", Part(CacheConfig, "disk_tier_bytes", type=ByteCount)),
    ("disk_tier_dir", Part(CacheConfig, "disk_tier_dir")),
    ("host_tier_shared", Part(CacheConfig, "host_tier_shared")),
    ("host_tier_dir", Part(CacheConfig, "host_tier_dir")),
    ("tier_policy", Part(CacheConfig, "tier_policy")),
    ("tier_load_timeout_s", Part(CacheConfig, "tier_load_timeout_s")),
    ("kv_cache_dtype", Part(CacheConfig, "kv_cache_dtype")),
    ("fused_decode", Part(EngineConfig, "fused_decode")),
    ("cpu_kernels", Part(EngineConfig, "cpu_kernels")),
    ("device", Part(EngineConfig, "device")),
    ("cuda_graphs", Part(EngineConfig, "cuda_graphs")),
    ("cuda_graph_batch_sizes", Part(EngineConfig, "cuda_graph_batch_sizes")),
    ("kv_transfer_backend", Part(EngineConfig, "kv_transfer_backend")),
    ("omp_wait_policy", Part(EngineConfig, "omp_wait_policy")),
    ("niceness", Part(EngineConfig, "niceness")),
    ("memory_tuning", Part(EngineConfig, "memory_tuning")),
    ("prepack_weights", Part(EngineConfig, "prepack_weights")),
    ("quantized_batches", Part(EngineConfig, "quantized_batches")),
    ("lora", Part(EngineConfig, "lora")),
])
class EngineSection(DerivedSection):
    """Per-worker engine settings (workers.config)."""


class _Pool(DerivedSection):
    @property
    def gang_size(self) -> int:
        return self.ep_size * self.sp_size * self.tp_size

    @property
    def parallel(self) -> ParallelConfig:
        """The gang's ``workers.config.ParallelConfig`` (what each rank of a replica joins)."""
        return ParallelConfig(**owner_kwargs(self, ParallelConfig))


def _resource_pairs(value: Any) -> Any:
    """speculative.drafter_resources is a mapping in YAML, sorted (name, amount) pairs in SpeculativeConfig."""
    if isinstance(value, Mapping) and isinstance(value.get("drafter_resources"), Mapping):
        return {**value, "drafter_resources": sorted(value["drafter_resources"].items())}
    return value


@derived_section([
    ("model", (str | None, Field(None, description="The model the pool serves: a models[].served_name (or the "
               "last path component of its name). null = the default model (models[0], or the one `model`); with "
               "`models` every pool but a drafter pool names one. A drafter pool drafts for the pools naming it "
               "and leaves this unset.", json_schema_extra={"hint": "must name a served model (models[].name's "
                                                                    "last component, or its served_name)"}))),
    ("name", (str, Field("default", pattern=r"^[a-z][a-z0-9_]*$", description="Names the pool's actors "
              "(<name>-<index>) and worker ids.", json_schema_extra={"hint": "must be lower-case letters, digits and "
                                                                     "'_', starting with a letter (it names the actors)"}))),
    ("role", (Literal[ROLES], Field("colocated", description="colocated (each worker prefills and decodes), or "
              "prefill / decode: a disaggregated pair of pools (prefill computes prompts and sends their KV "
              "to a decode worker, which streams the tokens), or drafter: replicas of a draft model (its "
              "`drafter` keys, on its engine device and KV budget) that colocated / decode pools name in "
              "speculative.drafter_pool.", json_schema_extra={"hint": "must be one of colocated, prefill, decode, "
              "drafter (prefill + decode pools make a disaggregated deployment; drafter pools serve the drafts of "
              "the pools that name them in speculative.drafter_pool)"}))),
    ("replicas", (int, Field(1, ge=1, description="Replicas (gangs of ranks) in the pool."))),
    ("standby_replicas", (int, Field(0, ge=0, description="Standby replicas: started and loaded but unrouted (no "
                          "KV cache), promoted first on a scale-up, when they serve in about a second "
                          "(cluster/deploy/controller.py); one that dies is replaced. With model.shared_weights_dir "
                          "each maps the node's one copy of the weights. The autoscaler may change the count "
                          "(autoscaling.pools[].max_standby).", json_schema_extra={"hint": "must be >= 0"}))),
    ("standby_load", (Literal["model", "process"], Field("model", description="How far a standby replica is "
                      "brought up before a scale-up promotes it: model (loaded and warmed up, serves in about a "
                      "second) or process (a warm worker process only: imports, model config, tokenizer and CPU "
                      "kernels, no weights) (workers/server/actor.py prepare); a process standby holds less memory "
                      "and its promotion loads the weights (mapped from the node's snapshot with "
                      "model.shared_weights_dir) and warms up, skipping the process start and imports a new "
                      "replica pays.",
                      json_schema_extra={"hint": "must be model or process"}))),
    ("cpus_per_replica", (int | None, Field(None, ge=1, description="CPUs reserved per rank = its torch threads. "
                          "null: an embedded Ray shares this machine's CPUs, less one for the router, among the ranks "
                          "that leave it unset; with ray.address, 1 (cluster/deploy/cpu_share.py).",
                          json_schema_extra={"hint": "must be >= 1 (it is also the worker's torch thread count), or "
                                                     "null to use what the machine offers"}))),
    ("placement_strategy", (Literal[PLACEMENT_STRATEGIES], Field("SPREAD", description="SPREAD puts bundles on "
                            "different nodes when it can (losing a node loses one replica, not the pool); PACK fills "
                            "one node first; STRICT_SPREAD / STRICT_PACK require it."))),
    ("max_restarts", (int, Field(-1, ge=-1, description="How often Ray restarts a dead worker (-1 = forever).",
                      json_schema_extra={"hint": "must be -1 (forever) or >= 0"}))),
    ("engine", (EngineSection, Field(default_factory=EngineSection, description="Per-worker engine settings."))),
    ("ep_size", Part(ParallelConfig, "ep_size", "Expert-parallel ranks per replica: each holds a share of an MoE "
                     "model's experts (must divide them); 1 = off.")),
    ("tp_size", Part(ParallelConfig, "tp_size", "Tensor-parallel ranks per replica: every layer's heads, MLP width "
                     "and vocabulary sharded over them; 1 = off.")),
    ("sp_size", Part(ParallelConfig, "sp_size", "Sequence-parallel ranks per replica: long prefill chunks split over "
                     "them (ring attention); 1 = off.")),
    ("comm", Part(ParallelConfig, "comm", "How a gang's same-host CPU collectives travel: auto (shared memory where "
                  "every rank of a group is on one host, else the process group's backend) | shm (refuse to start "
                  "without it) | gloo (the process group's own collectives, for comparison).")),
    ("speculative", (Annotated[SpeculativeConfig, BeforeValidator(_resource_pairs)], Field(
        default_factory=SpeculativeConfig, description="Speculative decoding (workers.config.SpeculativeConfig); "
        "colocated and decode pools only."))),
    ("drafter", (DrafterConfig, Field(default_factory=DrafterConfig, description="What each replica of a role: "
                 "drafter pool runs (workers.config.DrafterConfig); drafter pools only."))),
    ("gpus_per_rank", (float, Field(0.0, description="GPUs each rank reserves (a fraction below 1 shares a GPU)."))),
    ("resources_per_rank", (Mapping[str, Any], Field(default_factory=dict, description="Custom Ray resources per "
                            "rank, e.g. {duet_pool_decode: 1} where only the decode pool's nodes offer it, so no rank "
                            "lands on another pool's (or the drafters') nodes and an autoscaler adds the right ones.",
                            json_schema_extra={"additionalProperties": {"type": "number", "exclusiveMinimum": 0}}))),
])
class PoolSection(_Pool):
    """One worker pool: ``replicas`` replicas, each a gang of
    ``gang_size`` = ep_size * sp_size * tp_size ranks (Ray actors); each rank reserves one placement
    group bundle of ``cpus_per_replica`` CPUs, ``gpus_per_rank`` GPUs and ``resources_per_rank``
    (cluster/deploy/pools.py)."""


@derived_section([
    ("host", Part(RouterConfig, "host", "Bind address of both servers; 0.0.0.0 accepts other machines.")),
    ("port", Part(RouterConfig, "port", "gRPC port; 0 = any free port (logged).")),
    ("replicas", (int, Field(1, ge=1, le=16, description="Routers `duet serve` runs in its process, active-active on "
                  "consecutive ports from port and http_port (each follows the controller's member list and the "
                  "workers' reported prefix holdings; clients may use any). `duet router` and the chart's router "
                  "Deployment run one each.", json_schema_extra={"hint": "must be in 1..16"}))),
    ("http_port", Part(RouterConfig, "http_port", "OpenAI-compatible HTTP API port (/v1/chat/completions, "
                       "/v1/completions, /v1/models, /health, /metrics), same TLS and tokens; 0 = off.")),
    ("policy", Part(RouterConfig, "policy")),
    ("policy_options", Part(RouterConfig, "policy_options")),
    ("drafter_policy", Part(RouterConfig, "drafter_policy", "How a speculative request's drafter replica is picked "
                            "from the drafter pool its worker names (router/policies/drafter.py).")),
    ("drafter_policy_options", Part(RouterConfig, "drafter_policy_options", "Keyword options of the drafter policy, "
                                    "e.g. {fanout: 4} (the replicas one worker spreads its requests over).")),
    ("max_in_flight", Part(RouterConfig, "max_in_flight", "Requests streamed at once.")),
    ("max_queue", Part(RouterConfig, "max_queue", "Admitted requests waiting for an in-flight slot; beyond both "
                       "limits a request gets RESOURCE_EXHAUSTED.")),
    ("shutdown_grace_s", Part(RouterConfig, "shutdown_grace_s", "Seconds in-flight streams get to finish on shutdown.")),
    ("wake_timeout_s", Part(RouterConfig, "wake_timeout_s")),
    ("tls_cert_file", Part(RouterConfig, "tls_cert_file", "PEM certificate; with tls_key_file both ports serve TLS only.")),
    ("tls_key_file", Part(RouterConfig, "tls_key_file", "PEM private key of tls_cert_file.")),
    ("tls_client_ca_file", Part(RouterConfig, "tls_client_ca_file", "PEM CA: require client certificates it signed "
                                "(mTLS).")),
    ("auth_tokens_file", Part(RouterConfig, "auth_tokens_file", "Require 'authorization: Bearer <token>' on every "
                              "call but health checks, with a token from this file (one per line, optional scopes "
                              "'generate' and/or 'admin'; sha256:<hex> instead of a token).")),
    ("max_request_bytes", Part(RouterConfig, "max_request_bytes", "Largest request message; larger ones get "
                               "RESOURCE_EXHAUSTED unread.", type=ByteCount)),
    ("disagg_min_prompt_tokens", Part(RouterConfig, "disagg_min_prompt_tokens", "With a prefill pool, prompts "
                                      "shorter than this run colocated on a decode worker.")),
    ("prefix_pull_min_tokens", Part(RouterConfig, "prefix_pull_min_tokens", "A worker routed a prompt whose prefix "
                                    "of at least this many tokens another worker holds pulls that KV instead of "
                                    "recomputing it (router/policies/prefix_pull.py); 0 = off.")),
    ("multiplex_worker_streams", Part(RouterConfig, "multiplex_worker_streams", "Send each worker's requests on one "
                                      "stream, its output one message per step for all of them; false = a "
                                      "gRPC call per request.")),
    ("rebalance", Part(RouterConfig, "rebalance", "Move running requests from the hottest to the coolest decode "
                       "worker by live KV migration (router/rebalancer.py).")),
    ("rebalance_interval_s", Part(RouterConfig, "rebalance_interval_s", "Seconds between rebalancing rounds.")),
    ("rebalance_kv_gap", Part(RouterConfig, "rebalance_kv_gap", "Rebalance when a pool's decode workers' KV usage "
                              "differs by more than this fraction.")),
    ("rebalance_tpot_ratio", Part(RouterConfig, "rebalance_tpot_ratio", "... or their TPOT by more than this ratio.")),
    ("rebalance_request_cooldown_s", Part(RouterConfig, "rebalance_request_cooldown_s", "A moved request stays put "
                                          "this many seconds.")),
], probe={RouterConfig: {"tokenizer_path": "<model>"}})
class RouterSection(DerivedSection):
    """The public gRPC server and OpenAI-compatible HTTP API (router.config.RouterConfig; security: router/security.py)."""


class RaySection(Section):
    """Where the workers run."""

    address: str | None = Field(None, min_length=1, description="null = start an embedded local Ray (stopped "
                                "again on shutdown); 'auto', 'host:6379' or 'ray://host:port' = join an existing "
                                "cluster (left running; every node needs duet installed).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs the embedded Ray offers; null = all of this machine's.")
    namespace: str = Field("duet", min_length=1, description="Ray namespace of the worker actors (`duet status "
                           "--namespace` finds them there).")


_POSITIVE_SECONDS: JsonDict = {"hint": "must be > 0 seconds"}


class ControllerSection(Section):
    """Membership and health of the workers, and the member list routers follow."""

    poll_interval_s: float = Field(1.0, gt=0, json_schema_extra=_POSITIVE_SECONDS, description="Seconds between probes of each worker actor.")
    start_timeout_s: float = Field(300.0, gt=0, json_schema_extra=_POSITIVE_SECONDS, description="How long a worker may take to load its engine and "
                                   "serve (serve fails if no worker is up by then).")
    placement_timeout_s: float = Field(60.0, gt=0, json_schema_extra=_POSITIVE_SECONDS, description="With ray.address, how long `duet serve` waits for a "
                                       "pool's placement group (an autoscaler may still be adding nodes) before "
                                       "failing with what is missing.")
    host: str = Field("127.0.0.1", min_length=1, description="Where the controller serves duet.control.v1.Membership.")
    port: int = Field(50052, ge=0, le=65535, description="Port of the Membership service (0 = any free port); a "
                      "router elsewhere is started with `duet router --membership host:port`.",
                      json_schema_extra={"hint": "must be in 0..65535 (0 picks a free port)"})


class DuetConfig(Section):
    """The deployment's configuration (module docstring)."""

    model: ModelSection = Field(default_factory=ModelSection, description="What every worker serves (one model; "
                                "for several, list them in `models` instead).")
    models: tuple[ModelSection, ...] = Field((), description="Several models in one deployment: each pool serves "
                                             "the one its `model` names; requests select one by name. Empty: the "
                                             "one `model`. The first is the default (an empty request model).")
    pools: tuple[PoolSection, ...] = Field((PoolSection(),), description="Worker pools, each sized and placed on "
                                           "its own; all use the same engine.block_size.")
    router: RouterSection = Field(default_factory=RouterSection, description="The public gRPC and HTTP servers.")
    ray: RaySection = Field(default_factory=RaySection, description="Where the workers run.")
    controller: ControllerSection = Field(default_factory=ControllerSection, description="Worker membership.")
    autoscaling: AutoscalingSection = Field(default_factory=AutoscalingSection, description="The SLO autoscaler.")

    @property
    def pool(self) -> PoolSection:
        """The first pool (what ``pool.*`` env keys and flags set)."""
        return self.pools[0]

    @property
    def served_models(self) -> tuple[ModelSection, ...]:
        """Every model the deployment serves, the default first (``models``, or the one ``model``)."""
        return self.models or (self.model,)

    def model_of(self, pool: PoolSection) -> ModelSection:
        """The model ``pool`` serves (its ``model`` key; unset: the default model)."""
        if pool.model is None:
            return self.served_models[0]
        return next(m for m in self.served_models if m.served == pool.model)

    def model_name_of(self, pool: PoolSection) -> str:
        """What the membership tells routers a worker of ``pool`` serves ("" = the default model)."""
        return "" if pool.role == "drafter" or pool.model is None else pool.model

    def pools_of(self, model: ModelSection) -> tuple[PoolSection, ...]:
        """The pools serving ``model`` (drafter pools excluded)."""
        return tuple(p for p in self.target_pools if self.model_of(p).served == model.served)

    def to_engine_config(self, pool: PoolSection | None = None) -> EngineConfig:
        """The ``workers.config.EngineConfig`` every worker of ``pool`` (default: the pool) runs:
        its model's keys (``model_of``) and the pool's engine keys."""
        pool = pool or self.pool
        e = pool.engine
        return EngineConfig(**owner_kwargs(self.model_of(pool), EngineConfig), **owner_kwargs(e, EngineConfig),
                            cache=CacheConfig(**owner_kwargs(e, CacheConfig)),
                            scheduler=SchedulerConfig(**owner_kwargs(e, SchedulerConfig)),
                            speculative=pool.speculative)

    def to_drafter_engine_config(self, pool: PoolSection) -> EngineConfig:
        """The ``workers.config.EngineConfig`` of a drafter pool's replicas (its ``drafter`` model and
        quantization on its ``engine`` device, KV budget and block size; float32 when quantized; no
        lower KV tiers: a small model's prefix is cheaper to recompute than to keep)."""
        d, e = pool.drafter, pool.engine
        return EngineConfig(model=d.model or "", quantization=d.quantization,
                            dtype="float32" if d.quantization != "none" else "auto",
                            device=e.device, fused_decode=e.fused_decode, cpu_kernels=e.cpu_kernels,
                            cache=CacheConfig(block_size=e.block_size, kv_cache_memory_bytes=e.kv_cache_memory_bytes,
                                              host_tier_bytes=0))

    @property
    def target_pools(self) -> tuple[PoolSection, ...]:
        """The pools that serve requests (every role but drafter)."""
        return tuple(p for p in self.pools if p.role != "drafter")

    @property
    def drafter_leaders(self) -> dict[str, list[str]]:
        """Drafter pool -> the pools drafting on it (their speculative.drafter_pool)."""
        return {d.name: [p.name for p in self.pools if p.speculative.drafter_pool == d.name]
                for d in self.pools if d.role == "drafter"}

    def to_router_config(self, tokenizer_path: str | Mapping[str, str], max_model_len: int | Mapping[str, int] | None = None,
                         **extra: Any) -> RouterConfig:
        """The ``router.config.RouterConfig``. tokenizer_path: the resolved checkpoint directory of
        the default model, or served name -> directory for every model; max_model_len: the
        workers' effective limit (one number, or served name -> limit; default: each model's
        ``max_model_len``); extra: further RouterConfig fields (tests shorten poll intervals)."""
        paths = tokenizer_path if isinstance(tokenizer_path, Mapping) else {self.served_models[0].served: tokenizer_path}
        limits = (max_model_len if isinstance(max_model_len, Mapping)
                  else {self.served_models[0].served: max_model_len} if max_model_len is not None else {})
        specs = [ModelSpec(m.served, paths[m.served], limits.get(m.served, m.max_model_len),
                           tuple(AdapterSpec(**owner_kwargs(a, AdapterSpec)) for a in m.adapters), m.adapter_dir)
                 for m in self.served_models]
        first = specs[0]
        return RouterConfig(
            tokenizer_path=first.tokenizer_path, model_name=first.name, max_model_len=first.max_model_len,
            adapters=first.adapters, adapter_dir=first.adapter_dir, models=tuple(specs[1:]),
            **owner_kwargs(self.router, RouterConfig), disagg_block_size=self.target_pools[0].engine.block_size,
            **extra)

    def to_autoscaler_config(self):
        """The ``cluster.autoscale.slo.AutoscalerConfig`` of the ``autoscaling`` section."""
        return to_autoscaler_config(self.autoscaling, {p.name: p.role for p in self.pools}, self.drafter_leaders)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``duet serve --dry-run`` prints as YAML)."""
        out = self.model_dump(mode="json")
        for pool in out["pools"]:
            pool["speculative"]["drafter_resources"] = dict(pool["speculative"]["drafter_resources"])
        return out


# ---------------------------------------------------------------------------------- env and flags
@dataclass(frozen=True)
class Switch:
    """How a setting is set at the edge. env: the variable (``parse`` turns its text into the value);
    flag: the ``duet serve`` flag. A ``pools[*]`` key applies to every pool, a ``pool.`` key to the first."""

    env: str | None = None
    flag: str | None = None
    parse: Callable[[str], Any] = str


def _negate(value: str) -> str:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return "false"
    if text in ("0", "false", "no", "off"):
        return "true"
    raise ClusterConfigError(f"env DUET_DISABLE_CPU_KERNELS={value!r}: must be 1 (true) or 0 (false)")


# dotted key -> its env var and flag. RAY_ADDRESS is Ray's own convention. The library reads none of
# them: they reach the workers through their EngineConfig / ParallelConfig.
SWITCHES: dict[str, Switch] = {
    "model.name": Switch("DUET_MODEL", "--model"),
    "model.dtype": Switch("DUET_DTYPE", "--dtype"),
    "model.max_model_len": Switch("DUET_MAX_MODEL_LEN", "--max-model-len"),
    "model.quantization": Switch("DUET_QUANTIZATION", "--quantization"),
    "model.shared_weights_dir": Switch("DUET_SHARED_WEIGHTS_DIR", "--shared-weights-dir"),
    "pool.replicas": Switch("DUET_REPLICAS", "--replicas"),
    "pool.standby_replicas": Switch("DUET_STANDBY_REPLICAS", "--standby-replicas"),
    "pool.cpus_per_replica": Switch("DUET_CPUS_PER_REPLICA", "--cpus-per-replica"),
    "pool.gpus_per_rank": Switch("DUET_GPUS_PER_RANK", "--gpus-per-rank"),
    "pool.engine.kv_cache_memory_bytes": Switch("DUET_KV_CACHE_MEMORY", "--kv-cache-memory"),
    "pool.engine.device": Switch("DUET_DEVICE", "--device"),
    "pool.engine.cuda_graphs": Switch("DUET_CUDA_GRAPHS", "--cuda-graphs"),
    "pool.speculative.drafter_device": Switch("DUET_DRAFTER_DEVICE", "--drafter-device"),
    "pools[*].engine.fused_decode": Switch("DUET_FUSED_DECODE"),  # 0 = off (A/B runs)
    "pools[*].engine.cpu_kernels": Switch("DUET_DISABLE_CPU_KERNELS", parse=_negate),  # 1 = torch references
    "pools[*].comm": Switch("DUET_COMM"),
    "router.host": Switch("DUET_HOST", "--host"),
    "router.port": Switch("DUET_PORT", "--port"),
    "router.replicas": Switch("DUET_ROUTERS", "--routers"),
    "router.http_port": Switch("DUET_HTTP_PORT", "--http-port"),
    "router.policy": Switch("DUET_POLICY", "--policy"),
    "router.tls_cert_file": Switch("DUET_TLS_CERT_FILE", "--tls-cert"),
    "router.tls_key_file": Switch("DUET_TLS_KEY_FILE", "--tls-key"),
    "router.tls_client_ca_file": Switch("DUET_TLS_CLIENT_CA_FILE", "--tls-client-ca"),
    "router.auth_tokens_file": Switch("DUET_AUTH_TOKENS_FILE", "--auth-tokens-file"),
    "controller.port": Switch("DUET_CONTROLLER_PORT", "--controller-port"),
    "ray.address": Switch("RAY_ADDRESS", "--ray-address"),
    "ray.num_cpus": Switch("DUET_RAY_NUM_CPUS", "--ray-num-cpus"),
}
CONFIG_ENV = "DUET_CONFIG"  # a YAML file used when --config is not given


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
    sources = {} if sources is None else sources
    raw: dict[str, Any] = {}
    path = path if path is not None else env.get(CONFIG_ENV) or None
    if path is not None:
        raw = read_yaml(DuetConfig, Path(path))
        mark_sources(raw, "", f"{path}", sources)
    pools = raw.get("pools")
    num_pools = len(pools) if isinstance(pools, list) and pools else 1
    env_values = [(key.replace("[*]", f"[{i}]"), switch.parse(env[switch.env]), f"env {switch.env}")
                  for key, switch in SWITCHES.items() if switch.env and env.get(switch.env)
                  for i in range(num_pools if "[*]" in key else 1)]
    flags = flag_names or {}
    flag_values = [(key, value, f"flag {flags.get(key, key)}") for key, value in (overrides or {}).items()
                   if value is not None]
    for layer in (KeySource(DuetConfig, env_values), KeySource(DuetConfig, flag_values)):
        raw = merge(raw, layer())
        sources.update(layer.sources)
    try:
        config = DuetConfig.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e, DuetConfig, sources) from None
    _check(config, sources)
    return config


# ---------------------------------------------------------------------------------- checks across keys
def _check(c: DuetConfig, s: Sources) -> None:
    """What one value's type and bounds cannot say: the lower types' own checks and the checks across keys."""
    _check_models(c, s)
    for i, pool in enumerate(c.pools):
        check_derived(pool.engine, f"pools[{i}].engine", s)
        check_derived(pool, f"pools[{i}]", s)  # ep_size, tp_size, sp_size, comm: ParallelConfig's checks
        _check_placement_resources(pool, f"pools[{i}]", s)
    _check_router(c.router, "router", s)
    need(c.ray.num_cpus is None or c.ray.address is None, "ray.num_cpus", c.ray.num_cpus, s,
         f"only applies to an embedded Ray; unset it or unset ray.address ({c.ray.address!r})")
    check_autoscaling(c.autoscaling, "autoscaling", s)
    names = [pool.name for pool in c.pools]
    need(len(c.pools) >= 1, "pools", names, s, "must hold at least one pool")
    need(len(set(names)) == len(names), "pools", names, s, "pool names must be unique (they name the actors)")
    need(bool({pool.role for pool in c.pools} & {"colocated", "decode"}), "pools", names, s,
         "needs a colocated or decode pool to stream tokens (a prefill pool only computes prompts)")
    _check_model_pools(c, s)
    sizes = {pool.engine.block_size for pool in c.pools if pool.role != "drafter"}  # a drafter's KV stays home
    need(len(sizes) == 1, "pools", names, s,
         f"every pool must use the same engine.block_size (KV blocks move between them), got {sorted(sizes)}")
    for i in range(len(c.pools)):
        _check_engine_config(c, i, s)
    check_combinations(c, s)
    check_against_pools(c.autoscaling, {pool.name: pool.role for pool in c.pools},
                        {pool.name: pool.replicas for pool in c.pools}, s, c.drafter_leaders)


def _model_key(c: DuetConfig, i: int) -> str:
    """The dotted key of served model i (``model`` for the one model, ``models[i]`` of several)."""
    return f"models[{i}]" if c.models else "model"


def _check_models(c: DuetConfig, s: Sources) -> None:
    """Each model's own checks; ``model`` xor ``models``; unique served names (models and adapters
    alike); every pool names a served model; every model has a pool that streams tokens."""
    if c.models:
        changed = next((k for k, v in c.model if v != getattr(ModelSection(), k)), "name")
        need(c.model == ModelSection(), f"model.{changed}", getattr(c.model, changed), s, "set either `model` (one "
             "model) or `models` (several), not both: move it into models (--model / DUET_MODEL set `model`)")
    seen: dict[str, str] = {}
    for i, m in enumerate(c.served_models):
        key = _model_key(c, i)
        check_derived(m, key, s)
        need(bool(m.served.strip()) and ":" not in m.served, f"{key}.served_name", m.served, s,
             "must be a non-empty name without ':' ('<model>:<adapter>' names an adapter)")
        need(m.served not in seen, f"{key}.name", m.name, s, f"two models with one name {m.served!r} "
             f"({seen.get(m.served)} too); set served_name on one of them")
        seen[m.served] = key
        for j, a in enumerate(m.adapters):
            check_derived(a, f"{key}.adapters[{j}]", s)
            need(a.name not in seen, f"{key}.adapters[{j}].name", a.name, s,
                 f"the name is taken by {seen.get(a.name)}; model and adapter names must be unique")
            seen[a.name] = f"{key}.adapters[{j}]"
    served = {m.served for m in c.served_models}
    for i, pool in enumerate(c.pools):
        if pool.role == "drafter":
            need(pool.model is None, f"pools[{i}].model", pool.model, s, "a drafter pool drafts for the pools naming "
                 "it in speculative.drafter_pool (whatever their model); leave model unset")
            continue
        need(pool.model is not None or not c.models or len(c.models) == 1, f"pools[{i}].model", pool.model, s,
             f"with several models each pool names the one it serves: one of {', '.join(sorted(served))}")
        need(pool.model is None or pool.model in served, f"pools[{i}].model", pool.model, s,
             f"unknown model; served: {', '.join(sorted(served))}")


def _check_model_pools(c: DuetConfig, s: Sources) -> None:
    """A model with adapters (``adapters`` or ``adapter_dir``) has a pool with engine.lora.enabled (else
    every request naming one would be refused); with several models, each has a pool that streams its
    tokens (colocated or decode)."""
    several = c.served_models if len(c.served_models) > 1 else ()  # one model: the check across all pools says it
    for i, m in enumerate(several):
        roles = {p.role for p in c.pools_of(m)}
        need(bool(roles & {"colocated", "decode"}), f"{_model_key(c, i)}.name", m.name, s,
             f"no colocated or decode pool serves {m.served!r} (set `model: {m.served}` on one)" if roles else
             f"no pool serves {m.served!r}: add one with `model: {m.served}`, or remove the model")
    for i, m in enumerate(c.served_models):
        if not (m.adapters or m.adapter_dir):
            continue
        serving = {q.name for q in c.pools_of(m)}  # names are unique (checked before)
        pools = [(j, p) for j, p in enumerate(c.pools) if p.name in serving]
        key = f"{_model_key(c, i)}.{'adapters' if m.adapters else 'adapter_dir'}"
        need(any(p.engine.lora.enabled for _, p in pools), key,
             [a.name for a in m.adapters] if m.adapters else m.adapter_dir, s,
             f"no pool serving {m.served!r} has engine.lora.enabled, so its workers would refuse every adapter; "
             f"set {' / '.join(f'pools[{j}].engine.lora.enabled' for j, _ in pools) or 'engine.lora.enabled'}: true "
             "(docs/serving/lora-engine.md), or drop the adapters")


def _check_placement_resources(pool: PoolSection, p: str, s: Sources) -> None:
    """gpus_per_rank and resources_per_rank in the shapes Ray accepts for a bundle and an actor."""
    g = pool.gpus_per_rank
    need(g >= 0 and (g <= 1 or g.is_integer()), f"{p}.gpus_per_rank", g, s,
         "must be >= 0: a whole number of GPUs, or a fraction below 1 to share one GPU")
    for name, amount in pool.resources_per_rank.items():
        key, given = f"{p}.resources_per_rank", dict(pool.resources_per_rank)
        need(bool(name.strip()), key, given, s, "must map Ray resource names to amounts, e.g. {duet_pool_decode: 1}")
        need(name not in ("CPU", "GPU"), key, given, s, f"{name} has its own key: set cpus_per_replica / gpus_per_rank "
             "instead")
        need(isinstance(amount, (int, float)) and not isinstance(amount, bool) and 0 < amount < float("inf"),
             key, given, s, f"{name}: amounts must be numbers > 0")


def _check_router(r: RouterSection, p: str, s: Sources) -> None:
    # Files are checked here, at the edge, where they are read; everything else is RouterConfig's.
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
        path = getattr(r, name)
        need(path is None or Path(path).expanduser().is_file(), f"{p}.{name}", path, s,
             "must be a readable file (PEM for TLS; see router/security.py for the tokens file)")
    check_derived(r, p, s)


def _check_engine_config(c: DuetConfig, i: int, s: Sources) -> None:
    """Build pool i's EngineConfig: the engine's checks across model, engine and speculative keys (a
    drafter pool's: across its drafter and engine keys)."""
    pool = c.pools[i]
    if pool.role == "drafter" and not pool.drafter.model:
        return  # refused by check_combinations, naming drafter.model
    try:
        c.to_drafter_engine_config(pool) if pool.role == "drafter" else c.to_engine_config(pool)
    except ValueError as e:
        if not is_lower_config_error(e):
            raise
        model = c.model_of(pool)
        keys = {**keymap(model, _model_key(c, c.served_models.index(model))),
                **keymap(pool.engine, f"pools[{i}].engine")}
        if pool.role == "drafter":
            keys.update({"model": (f"pools[{i}].drafter.model", pool.drafter.model),
                         "quantization": (f"pools[{i}].drafter.quantization", pool.drafter.quantization)})
        keys.update({f"speculative.{name}": (f"pools[{i}].speculative.{name}", getattr(pool.speculative, name))
                     for name in SpeculativeConfig.__dataclass_fields__})
        raise lower_error(e, keys, s) from None
