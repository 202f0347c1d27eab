"""Assemble today's engine from its parts: ``build_engine(config)``.

The engine (workers/engine/engine.py) takes its collaborators ready-made: a Runner, a tokenizer and,
when speculating, a Speculator over a Proposer. This module is where the default parts are chosen,
above both the engine and the proposers (workers/spec_decode/), so neither imports the other's
construction:

    runner     ``ModelRunner.from_config(config)`` (one process), unless given: a gang's leader
               passes its GangRunner (workers/engine/gang_runner.py)
    tokenizer  the checkpoint's own (transformers ``AutoTokenizer``; with ``shared_weights_dir`` set, from
               the node's record of it when an earlier start wrote one: workers/models/tokenizer_record.py)
    proposer   from ``config.speculative`` (workers/spec_decode/factory.py), none when speculation
               is off, unless given
    tiers      the lower KV tiers ``config.cache`` asks for (workers/kv/tiers/store.py), none by
               default; checked against the runner's KV layout and model fingerprint

``config.model`` must already be a checkpoint directory: names, Hub ids and ``.gguf`` files are
resolved at the edges (workers/models/assets/resolve.py: ``duet serve``'s actors, ``LLM``).

A standby replica (cluster/deploy/pools.py) holds a ``Preloaded``: the model (its weights mapped
from the node's snapshot with ``shared_weights_dir``) and tokenizer, no KV cache and no engine,
warmed up once through a throwaway engine (``Preloaded.warm_up``). Promoting it builds the runner's
KV cache and the engine around them (``Preloaded.runner``): loading and first-call costs are paid.

A warm worker process (a standby replica with the pool's ``standby_load: process``) holds less: it
ran ``prewarm``, which pays a fresh process's one-time costs that do not need the model loaded
(transformers' configuration and tokenizer code imported by reading the checkpoint's config and
tokenizer, the CPU kernels loaded) and keeps the tokenizer; its promotion is a whole start in that
process (``build_engine(config, tokenizer=...)``: weights, KV cache, warm-up) minus the process
start, the imports and those reads.

Worked example::

    path = resolve_model("SmolLM2-135M-Instruct")
    engine = build_engine(EngineConfig(model=str(path)))
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from workers.config import EngineConfig, SpeculativeConfig
from workers.errors import ConfigError
from workers.engine.device import resolve_for_process
from workers.engine.engine import Engine
from workers.engine.model_runner import ModelRunner, cache_blocks
from workers.engine.proposer import Proposer
from workers.engine.runner import Runner, kv_fingerprint
from workers.engine.speculator import Speculator
from workers.models.checkpoint import checkpoint_dir
from workers.models.spec_record import record_dir
from workers.models.tokenizer_record import load_tokenizer
from workers.kv.tiers.store import make_tier_store
from workers.spec_decode.factory import make_proposer
from workers.startup import StartupTimeline

logger = logging.getLogger(__name__)


def build_engine(config: EngineConfig, *, runner: Runner | None = None, tokenizer: Any | None = None,
                 proposer: Proposer | None = None, timeline: StartupTimeline | None = None) -> Engine:
    """An engine over ``runner`` (default: a ModelRunner loading ``config.model``), the model's
    tokenizer and a speculator over ``proposer`` (default: built from ``config.speculative``).
    timeline: marks the start-up phases this runs (workers/startup.py: kernels, weights and kv when
    it loads the runner, tokenizer when it loads one, cuda_graphs when it captures them).
    Raises ConfigError when ``config.model`` is not a checkpoint directory or the device is refused."""
    path = checkpoint_dir(config.model)
    # device/dtype 'auto' -> concrete values; device cuda without CUDA is refused naming the key
    config = resolve_for_process(config, path)
    runner = runner or ModelRunner.from_config(config, timeline)
    if tokenizer is None:
        tokenizer = load_tokenizer(path, record_dir(config.shared_weights_dir))
        if timeline is not None:
            timeline.mark("tokenizer")
    if proposer is None and config.speculative.enabled:
        proposer = make_proposer(config.speculative, config, runner.spec.vocab_size)
    speculator = Speculator(proposer, config.speculative) if proposer is not None else None
    layout = runner.kv_layout()
    tier_store = make_tier_store(config.cache, layout.whole(), kv_fingerprint(runner.spec, layout.dtype,
                                 config.quantization), pin=config.device.startswith("cuda"),
                                 device_blocks=runner.num_blocks)
    adapters = runner.adapters if isinstance(runner, ModelRunner) else None  # LoRA: a one-rank runner's (lora.enabled)
    engine = Engine(config, runner, tokenizer, speculator=speculator, tier_store=tier_store, adapters=adapters)
    if config.cuda_graphs:
        if not isinstance(runner, ModelRunner):  # the cluster config refuses the combination first
            raise ConfigError(f"cuda_graphs=true: {type(runner).__name__} captures no CUDA graphs (only a one-rank "
                              "ModelRunner does); set cuda_graphs to false")
        runner.capture_graphs(engine.max_model_len)
        if timeline is not None:
            timeline.mark("cuda_graphs")
    logger.info("engine ready: %s, %d KV blocks x %d tokens, max_model_len %d", path, runner.num_blocks,
                runner.block_size, engine.max_model_len)
    return engine


@dataclass(frozen=True)
class Preloaded:
    """A loaded model and its tokenizer, without a KV cache or an engine (module docstring)."""

    model: Any  # torch.nn.Module
    spec: Any  # workers.models.config.ModelSpec
    tokenizer: Any

    def warm_up(self, config: EngineConfig, timeline: StartupTimeline | None = None) -> None:
        """Pay the first-call costs now (kernels' first use, allocator growth, thread start) with one
        warm-up request through a throwaway engine over a few KV blocks, no speculation and no prefix
        cache; the engine a promotion builds then needs no warm-up of its own (marks warm_up)."""
        blocks = max(2, math.ceil(16 / config.cache.block_size) + 1)  # a warm-up request is <= 12 tokens
        tiny = dataclasses.replace(config, speculative=SpeculativeConfig(), cache=dataclasses.replace(
            config.cache, num_blocks=blocks, enable_prefix_caching=False))
        build_engine(tiny, runner=self.runner(tiny), tokenizer=self.tokenizer).warm_up()
        if timeline is not None:
            timeline.mark("warm_up")

    def runner(self, config: EngineConfig, timeline: StartupTimeline | None = None) -> ModelRunner:
        """A ModelRunner over the loaded model with the KV cache ``config`` asks for (marks kv)."""
        config = resolve_for_process(config, checkpoint_dir(config.model))
        runner = ModelRunner(self.model, self.spec, config, cache_blocks(config, self.spec))
        if timeline is not None:
            timeline.mark("kv")
        return runner


def preload(config: EngineConfig, timeline: StartupTimeline | None = None) -> Preloaded:
    """Load ``config``'s model and tokenizer, nothing else (marks kernels, weights, tokenizer)."""
    path = checkpoint_dir(config.model)
    config = resolve_for_process(config, path)
    model, spec = ModelRunner.load(config, timeline)
    tokenizer = load_tokenizer(path, record_dir(config.shared_weights_dir))
    if timeline is not None:
        timeline.mark("tokenizer")
    return Preloaded(model, spec, tokenizer)


def prewarm(config: EngineConfig, timeline: StartupTimeline | None = None) -> Any:
    """A warm worker process's preparation (module docstring): read ``config``'s model config, load the
    CPU kernels and the tokenizer, and return the tokenizer; no weights, no KV cache (marks config,
    kernels, tokenizer)."""
    config = resolve_for_process(config, checkpoint_dir(config.model))
    ModelRunner.load_spec_and_kernels(config, timeline)
    tokenizer = load_tokenizer(checkpoint_dir(config.model), record_dir(config.shared_weights_dir))
    if timeline is not None:
        timeline.mark("tokenizer")
    return tokenizer

