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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.config.duet import DuetConfig
from cluster.config.derive import keymap
from cluster.config.sources import ClusterConfigError, is_lower_config_error, lower_error, source_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preflight:
    """What the checks found: the target's checkpoint directory and architecture."""

    model_path: Path
    model_type: str
    num_experts: int


def preflight(config: DuetConfig, sources: dict[str, str] | None = None) -> Preflight:
    """Resolve and check the models of every pool (module docstring)."""
    from workers.models.assets.resolve import resolve_model
    from workers.models.support import check_support

    sources = sources or {}
    path = resolve_model(config.model.name)
    spec = None
    for i, pool in enumerate(config.pools):
        one_rank = replace(pool.parallel, ep_size=1, sp_size=1, tp_size=1)
        if pool.role == "drafter":
            drafter = config.to_drafter_engine_config(pool)
            draft_path = resolve_model(pool.drafter.model)
            _checked(lambda: check_support(draft_path, drafter, one_rank), config, i, sources, drafter=True)  # noqa: B023 - called in this iteration
            _check_tokenizer(config, path, draft_path, f"pools[{i}].drafter.model", pool.drafter.model, sources)
            continue
        engine = config.to_engine_config(pool)
        spec = _checked(lambda: check_support(path, engine, pool.parallel), config, i, sources)  # noqa: B023 - called in this iteration
        sp = pool.speculative
        if sp.method == "draft_model" and not sp.drafter_pool:
            draft_path = resolve_model(sp.draft_model)
            drafter = replace(engine, model=sp.draft_model, quantization=sp.draft_quantization)
            _checked(lambda: check_support(draft_path, drafter, one_rank), config, i, sources, drafter=True)  # noqa: B023 - called in this iteration
            _check_tokenizer(config, path, draft_path, f"pools[{i}].speculative.draft_model", sp.draft_model, sources)
    assert spec is not None  # config validation requires a target pool
    logger.info("duet: model %s -> %s (%s%s)", config.model.name, path, spec.model_type,
                f", {spec.num_experts} experts" if spec.num_experts else "")
    return Preflight(path, spec.model_type, spec.num_experts)


def _check_tokenizer(config: DuetConfig, target_path: Path, draft_path: Path, key: str, draft: str,
                     sources: dict[str, str]) -> None:
    """The drafter at ``key`` (named ``draft``) must share the target's tokenizer."""
    from workers.spec_decode.tokenizers import tokenizer_mismatch

    why = tokenizer_mismatch(target_path, draft_path)
    if why is not None:
        raise ClusterConfigError(
            f"{key}={draft!r} ({source_of(key, sources)}): its tokenizer cannot serve the target model "
            f"model.name={config.model.name!r}: {why}; a drafter must share the target's tokenizer (e.g. a "
            "smaller model of the same family)")


def _checked(check: Any, config: DuetConfig, i: int, sources: dict[str, str], drafter: bool = False) -> Any:
    try:
        return check()
    except ValueError as e:
        if not is_lower_config_error(e):
            raise
        pool = config.pools[i]
        keys = {**keymap(pool, f"pools[{i}]"), "quantization": ("model.quantization", config.model.quantization)}
        if drafter and pool.role == "drafter":
            keys["quantization"] = (f"pools[{i}].drafter.quantization", pool.drafter.quantization)
        elif drafter:
            keys["quantization"] = (f"pools[{i}].speculative.draft_quantization", pool.speculative.draft_quantization)
        raise lower_error(e, keys, sources) from None
