"""Assemble today's engine from its parts: ``build_engine(config)``.

The engine (workers/engine/engine.py) takes its collaborators ready-made: a Runner, a tokenizer and,
when speculating, a Speculator over a Proposer. This module is where the default parts are chosen,
above both the engine and the proposers (workers/spec_decode/), so neither imports the other's
construction:

    runner     ``ModelRunner.from_config(config)`` (one process), unless given: a gang's leader
               passes its GangRunner (workers/engine/gang_runner.py)
    tokenizer  the checkpoint's own (transformers ``AutoTokenizer``)
    proposer   from ``config.speculative`` (workers/spec_decode/factory.py), none when speculation
               is off, unless given
    tiers      the lower KV tiers ``config.cache`` asks for (workers/kv/tiers/store.py), none by
               default; checked against the runner's KV layout and model fingerprint

``config.model`` must already be a checkpoint directory: names, Hub ids and ``.gguf`` files are
resolved at the edges (workers/models/assets/resolve.py: ``duet serve``'s actors, ``LLM``).

Worked example::

    path = resolve_model("SmolLM2-135M-Instruct")
    engine = build_engine(EngineConfig(model=str(path)))
"""

from __future__ import annotations

import logging
from typing import Any

from workers.config import EngineConfig
from workers.errors import ConfigError
from workers.engine.device import resolve_for_process
from workers.engine.engine import Engine
from workers.engine.model_runner import ModelRunner
from workers.engine.proposer import Proposer
from workers.engine.runner import Runner, kv_fingerprint
from workers.engine.speculator import Speculator
from workers.models.checkpoint import checkpoint_dir
from workers.kv.tiers.store import make_tier_store
from workers.spec_decode.factory import make_proposer

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig, *, runner: Runner | None = None, tokenizer: Any | None = None,
                 proposer: Proposer | None = None) -> Engine:
    """An engine over ``runner`` (default: a ModelRunner loading ``config.model``), the model's
    tokenizer and a speculator over ``proposer`` (default: built from ``config.speculative``).
    Raises ConfigError when ``config.model`` is not a checkpoint directory or the device is refused."""
    path = checkpoint_dir(config.model)
    # device/dtype 'auto' -> concrete values; device cuda without CUDA is refused naming the key
    config = resolve_for_process(config, path)
    runner = runner or ModelRunner.from_config(config)
    if tokenizer is None:
        from transformers import AutoTokenizer  # deferred: transformers is slow to import

        tokenizer = AutoTokenizer.from_pretrained(path)
    if proposer is None and config.speculative.enabled:
        proposer = make_proposer(config.speculative, config, runner.spec.vocab_size)
    speculator = Speculator(proposer, config.speculative) if proposer is not None else None
    layout = runner.kv_layout()
    tier_store = make_tier_store(config.cache, layout.whole(), kv_fingerprint(runner.spec, layout.dtype,
                                 config.quantization), pin=config.device.startswith("cuda"))
    engine = Engine(config, runner, tokenizer, speculator=speculator, tier_store=tier_store)
    if config.cuda_graphs:
        if not isinstance(runner, ModelRunner):  # the cluster config refuses the combination first
            raise ConfigError(f"cuda_graphs=true: {type(runner).__name__} captures no CUDA graphs (only a one-rank "
                              "ModelRunner does); set cuda_graphs to false")
        runner.capture_graphs(engine.max_model_len)
    logger.info("engine ready: %s, %d KV blocks x %d tokens, max_model_len %d", path, runner.num_blocks,
                runner.block_size, engine.max_model_len)
    return engine
