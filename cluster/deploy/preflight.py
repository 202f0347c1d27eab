"""Checks that need the model, run before Ray or any actor starts (``duet serve``, ``--dry-run``).

Config validation (cluster/config/duet.py) knows the keys; this knows the checkpoint. For the target
model and every drafter (a pool's private ``speculative.draft_model``, or a drafter pool's
``drafter.model``): the name resolves to a checkpoint (workers/models/assets/resolve.py) and its
architecture can run with the pool's parallel layout and quantization (workers/models/support.py);
a drafter's tokenizer must also serve the target (workers/spec_decode/tokenizers.py: its ids mean
the same tokens). A failure is one ClusterConfigError naming the keys (``pools[0].tp_size=3 (from
duet.yaml): ...``, naming both models for a tokenizer) or the model error (ModelNotFoundError,
CheckpointError), never a worker that fails minutes later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cluster.config.duet import DuetConfig
from cluster.config.derive import keymap
from cluster.config.sources import ClusterConfigError, is_lower_config_error, lower_error, source_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the default model's checkpoint directory and architecture, and every
    served model's directory (served name -> path)."""

    model_path: Path
    model_type: str
    num_experts: int
    model_paths: dict[str, Path] = field(default_factory=dict)


def preflight(config: DuetConfig, sources: dict[str, str] | None = None) -> Preflight:
    """Resolve and check the models of every pool (module docstring)."""
    from workers.models.assets.resolve import resolve_model
    from workers.models.support import check_support

    sources = sources or {}
    paths = {m.served: resolve_model(m.name) for m in config.served_models}
    specs: dict[str, Any] = {}
    for i, pool in enumerate(config.pools):
        one_rank = replace(pool.parallel, ep_size=1, sp_size=1, tp_size=1)
        if pool.role == "drafter":
            drafter = config.to_drafter_engine_config(pool)
            draft_path = resolve_model(pool.drafter.model)
            _checked(lambda: check_support(draft_path, drafter, one_rank), config, i, sources, drafter=True)  # noqa: B023 - called in this iteration
            for leader in config.pools:  # every pool drafting on it: their models must share its tokenizer
                if leader.speculative.drafter_pool == pool.name:
                    _check_tokenizer(config, leader, paths, draft_path, f"pools[{i}].drafter.model",
                                     pool.drafter.model, sources)
            continue
        model = config.model_of(pool)
        path = paths[model.served]
        engine = config.to_engine_config(pool)
        specs[model.served] = _checked(lambda: check_support(path, engine, pool.parallel), config, i, sources)  # noqa: B023 - called in this iteration
        sp = pool.speculative
        if sp.method == "draft_model" and not sp.drafter_pool:
            draft_path = resolve_model(sp.draft_model)
            drafter = replace(engine, model=sp.draft_model, quantization=sp.draft_quantization)
            _checked(lambda: check_support(draft_path, drafter, one_rank), config, i, sources, drafter=True)  # noqa: B023 - called in this iteration
            _check_tokenizer(config, pool, paths, draft_path, f"pools[{i}].speculative.draft_model", sp.draft_model,
                             sources)
    default = config.served_models[0].served
    spec = specs[default]  # config validation requires a pool serving every model
    for name, path in paths.items():
        logger.info("duet: model %s -> %s (%s%s)", name, path, specs[name].model_type,
                    f", {specs[name].num_experts} experts" if specs[name].num_experts else "")
    return Preflight(paths[default], spec.model_type, spec.num_experts, paths)


def _check_tokenizer(config: DuetConfig, pool: Any, paths: dict[str, Path], draft_path: Path, key: str, draft: str,
                     sources: dict[str, str]) -> None:
    """The drafter at ``key`` (named ``draft``) must share the tokenizer of ``pool``'s model."""
    from workers.spec_decode.tokenizers import tokenizer_mismatch

    model = config.model_of(pool)
    why = tokenizer_mismatch(paths[model.served], draft_path)
    if why is not None:
        i = config.served_models.index(model)
        model_key = f"models[{i}].name" if config.models else "model.name"
        raise ClusterConfigError(
            f"{key}={draft!r} ({source_of(key, sources)}): its tokenizer cannot serve the target model "
            f"{model_key}={model.name!r} (pool {pool.name}): {why}; a drafter must share the target's tokenizer "
            "(e.g. a smaller model of the same family)")


def _checked(check: Any, config: DuetConfig, i: int, sources: dict[str, str], drafter: bool = False) -> Any:
    try:
        return check()
    except ValueError as e:
        if not is_lower_config_error(e):
            raise
        pool = config.pools[i]
        model = config.model_of(pool)
        model_key = f"models[{config.served_models.index(model)}]" if config.models else "model"
        keys = {**keymap(pool, f"pools[{i}]"), "quantization": (f"{model_key}.quantization", model.quantization)}
        if drafter and pool.role == "drafter":
            keys["quantization"] = (f"pools[{i}].drafter.quantization", pool.drafter.quantization)
        elif drafter:
            keys["quantization"] = (f"pools[{i}].speculative.draft_quantization", pool.speculative.draft_quantization)
        raise lower_error(e, keys, sources) from None
