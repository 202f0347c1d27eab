"""Offline batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Worked example::

    llm = LLM()  # SmolLM2-135M-Instruct on CPU
    [out] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out.text, out.finish_reason)

LoRA (lora=LoraConfig(enabled=True)): ``llm.load_adapter("sql", "/path/to/peft-adapter")``, then
``llm.generate(prompts, params, adapters=["sql", ""])`` runs the first prompt under adapter "sql"
and the second on the base model, in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import cast

from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.build import build_engine
from workers.models.assets.resolve import resolve_model
from workers.sample.logprobs import TokenLogprob
from workers.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason

Prompt = str | list[int]


@dataclass
class Completion:
    request_id: str
    prompt: Prompt
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, with top_logprobs set
    # why the request failed (finish_reason ABORT): structured output whose spec does not compile or
    # whose grammar admits no token at some step; the message names the field
    error: str | None = None


def engine_config(model: str = "SmolLM2-135M-Instruct", **kwargs) -> EngineConfig:
    """An EngineConfig from flat keywords: EngineConfig, CacheConfig and SchedulerConfig fields."""
    cache_keys = CacheConfig.__dataclass_fields__.keys()
    sched_keys = SchedulerConfig.__dataclass_fields__.keys()
    cache = CacheConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in cache_keys})
    sched = SchedulerConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in sched_keys})
    return EngineConfig(model=model, cache=cache, scheduler=sched, **kwargs)


class LLM:
    """Keyword arguments are EngineConfig fields (model, dtype, device, max_model_len, seed,
    quantization: 'none' | 'int8' | 'q4') or
    CacheConfig / SchedulerConfig fields (block_size, num_blocks, kv_cache_memory_bytes,
    enable_prefix_caching, max_num_batched_tokens, max_num_seqs), plus speculative (a
    SpeculativeConfig), proposer (a ready speculative-decoding proposer, see Engine) and runner
    (a ready workers.engine.runner.Runner, e.g. a gang leader's GangRunner; default: load the model)."""

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs) -> None:
        proposer = kwargs.pop("proposer", None)
        runner = kwargs.pop("runner", None)
        self.config = engine_config(str(resolve_model(model)), **kwargs)  # the edge: a name becomes a checkpoint dir
        self.engine = build_engine(self.config, runner=runner, proposer=proposer)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        adapters: str | list[str] | None = None,
    ) -> list[Completion]:
        """Run all prompts to completion with continuous batching; results in prompt order.
        adapters: the LoRA adapter of every prompt (one name for all, or one per prompt; "" = the
        base model), each loaded first (``load_adapter``)."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = cast(Sequence[Prompt], [prompts] if one else prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
        names = [adapters or ""] * len(batch) if adapters is None or isinstance(adapters, str) else adapters
        if len(names) != len(batch):
            raise ValueError(f"adapters: {len(names)} given for {len(batch)} prompts")
        results: dict[str, Completion] = {}
        try:
            for prompt, p, adapter in zip(batch, params, names):
                rid = self.engine.add_request(None, prompt, p, adapter=adapter)
                results[rid] = Completion(rid, prompt)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    c = results[out.request_id]
                    c.token_ids.extend(out.new_token_ids)
                    c.logprobs.extend(out.new_logprobs or ())
                    c.text += out.new_text
                    c.finish_reason = out.finish_reason
                    c.num_prompt_tokens = out.num_prompt_tokens
                    c.num_cached_tokens = out.num_cached_tokens
                    if out.error is not None:
                        c.error = str(out.error)
        except BaseException:
            for rid in results:  # leave the engine clean if a prompt was rejected or we were interrupted
                self.engine.abort(rid)
            raise
        return list(results.values())

    def load_adapter(self, name: str, source: str, pin: bool = False) -> None:
        """Load the PEFT adapter in directory ``source`` as ``name`` (needs lora=LoraConfig(enabled=True))."""
        if self.engine.adapters is None:
            raise ValueError("load_adapter: this LLM runs without LoRA; pass lora=LoraConfig(enabled=True)")
        self.engine.adapters.load(name, source, pin)

    def unload_adapter(self, name: str) -> None:
        if self.engine.adapters is None:
            raise ValueError("unload_adapter: this LLM runs without LoRA")
        self.engine.adapters.unload(name)
