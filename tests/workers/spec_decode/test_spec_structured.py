"""Structured output with speculative decoding: verification masks the target's logits at every draft
position with the grammar advanced through the drafts before it, and the matcher rolls back to the
accepted prefix; the drafters draft unconstrained. So greedy constrained output is identical with
and without speculation (n-gram and draft model), and sampled speculative output still validates.
The target and the drafter are tiny random models with SmolLM2's tokenizer (fast; their drafts are
often rejected by the grammar, which is the path under test)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from workers.config import SpeculativeConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter
from workers.structured.spec import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["aa", "bb", "cc"]}, "minItems": 1, "maxItems": 5},
                         "name": {"type": "string", "maxLength": 6}}}
# Forced stretches (the repeated literal) are where drafts get accepted: the prompt holds them too,
# so the n-gram proposer finds them, and the grammar's own mask makes the target agree.
REGEX = r"(item-[0-9], ){3,6}done"
PROMPT_TEXT = "item-1, item-2, item-3, item-4, item-5, done. Again: "
KW = dict(kv_cache_memory_bytes=16 << 20, block_size=8, max_num_batched_tokens=128)


def specs() -> list[StructuredOutput]:
    return [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("regex", REGEX),
            StructuredOutput("choice", choices=("item-1, item-2", "item-3, done"))]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT_TEXT)


@pytest.fixture(scope="module")
def plain(tiny_qwen2_path: Path) -> LLM:
    return LLM(str(tiny_qwen2_path), **KW)


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=48, structured=s) for s in specs()]


def run(llm: LLM, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([prompt] * len(params), params)
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks and not llm.engine._matchers
    return [o.token_ids for o in outs]


def test_ngram_greedy_identical_and_sampled_valid(tiny_qwen2_path: Path, plain: LLM, prompt):
    ngram = LLM(str(tiny_qwen2_path), speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                  adaptive=False), **KW)
    assert run(ngram, prompt, greedy_params()) == run(plain, prompt, greedy_params())
    spec = ngram.engine.stats().spec
    assert spec.num_verifies > 0 and spec.num_accepted_tokens > 0  # drafts were verified, some kept
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured=specs()[0]) for s in (1, 2, 3)]
    for out in ngram.generate([prompt] * 3, sampled):
        assert out.finish_reason is FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_draft_model_greedy_identical(tiny_qwen2_path: Path, plain: LLM, prompt, tmp_path: Path):
    """A different random tiny model drafts (unconstrained) for the target over gRPC."""
    from testkit.tp_cases import save_tiny_qwen2

    draft_path = save_tiny_qwen2(tmp_path / "draft", tiny_qwen2_path, seed=1, eos_token_id=2)
    from workers.config import CacheConfig, EngineConfig

    engine = DraftEngine(EngineConfig(model=str(draft_path), cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))
    server, endpoint = serve_drafter(engine)
    try:
        spec = SpeculativeConfig(method="draft_model", draft_model=str(draft_path), num_speculative_tokens=3,
                                 adaptive=False)
        llm = LLM(str(tiny_qwen2_path), speculative=spec,
                  proposer=DraftModelProposer(endpoint_connector(endpoint), overlap=False), **KW)
        assert run(llm, prompt, greedy_params()) == run(plain, prompt, greedy_params())
        assert llm.engine.stats().spec.num_verifies > 0
        llm.engine.speculator.close()
    finally:
        server.stop(grace=0)
        shutil.rmtree(draft_path, ignore_errors=True)
