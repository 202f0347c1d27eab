"""Speculative decoding with LoRA adapters: the drafter (n-gram, or a draft model without the adapter)
proposes, the target verifies under each request's adapter, so greedy output equals the same
adapter's plain greedy output token for token, in a batch that mixes adapters and the base model.
The drafter knows nothing of adapters: what an adapter costs is acceptance, not correctness."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.config import LoraConfig, SpeculativeConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter


PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat exactly: red green blue red green blue red green blue red green",
    "<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums<|im_end|>\n<|im_start|>assistant\n",
]
NAMES = ["qkvo", "", "mlp"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
LORA = LoraConfig(enabled=True, max_loaded=2, max_rank=16)


def _llm(path: Path, adapters: dict[str, Path], **kw) -> LLM:
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=128, lora=LORA, **kw)
    for name, p in adapters.items():
        llm.load_adapter(name, str(p))
    return llm


def _generate(llm: LLM, names: list[str]) -> list[list[int]]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = [c.token_ids for c in llm.generate(prompts, GREEDY, adapters=names)]
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    assert all(llm.engine.adapters.in_use(n) == 0 for n in llm.engine.adapters.names()), "adapter references leaked"
    return outs


@pytest.fixture(scope="module")
def plain(smollm2_path, smol_adapters) -> list[list[int]]:
    outs = _generate(_llm(smollm2_path, smol_adapters), NAMES * 2)
    assert outs[0] != _generate(_llm(smollm2_path, {}), [""])[0], "the adapter changes nothing: the test proves nothing"
    return outs


def test_ngram_speculation_under_adapters_equals_plain(smollm2_path, smol_adapters, plain) -> None:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    llm = _llm(smollm2_path, smol_adapters, speculative=spec)
    assert _generate(llm, NAMES * 2) == plain
    assert llm.engine.stats().spec.num_accepted_tokens > 0, "no draft was accepted: nothing was verified"


def test_a_base_draft_model_drafts_for_adapter_requests(smollm2_path, smol_adapters, plain) -> None:
    """The drafter runs the base model (int8), never the adapter: tokens still equal plain decoding."""
    from workers.config import CacheConfig, EngineConfig

    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)))
    server, endpoint = serve_drafter(engine)
    try:
        spec = SpeculativeConfig(method="draft_model", draft_model=str(smollm2_path), num_speculative_tokens=4,
                                 adaptive=False)
        llm = _llm(smollm2_path, smol_adapters, speculative=spec, proposer=DraftModelProposer(endpoint_connector(endpoint)))
        assert _generate(llm, NAMES * 2) == plain
        assert llm.engine.stats().spec.num_accepted_tokens > 0
    finally:
        server.stop(grace=0)
