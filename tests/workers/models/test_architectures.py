"""Every architecture family against transformers: a tiny random checkpoint (tests/testkit/tiny_families.py)
with the family's special options switched on gives the same greedy tokens through the offline
engine as transformers' ``generate``. The prompts are longer than every sliding window and cross
the block size, and prefill runs in several chunks, so windows, chunked prefill and decode all run."""

from __future__ import annotations

import pytest

from tests.testkit.tiny_families import CASES, NEW, PROMPTS, hf_generate
from workers.llm import LLM
from workers.sampling_params import SamplingParams


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    llm = LLM(str(path), kv_cache_memory_bytes=8 << 20, block_size=8, max_num_batched_tokens=32)
    assert llm.engine.spec.model_type == arch
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_generate(path, prompt, NEW), (case, prompt[:4])
