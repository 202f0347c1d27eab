"""Fixtures for engine tests: HF transformers greedy references, the SmolLM2 tokenizer and a default engine
(the shared prompts and the greedy check are in tests/testkit/greedy.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from testkit.greedy import NEW_TOKENS


@pytest.fixture(scope="session")
def hf_greedy(smollm2_path: Path) -> Callable[[list[int], int], list[int]]:
    """Greedy continuation from HF transformers generate(), memoised per (prompt ids, length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt_ids: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def llm(smollm2_path: Path):
    """The default engine (default chunking and block size), with a small KV budget for tests."""
    from workers.llm import LLM

    return LLM(str(smollm2_path), kv_cache_memory_bytes=128 << 20)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, smollm2_path: Path) -> Path:
    """A tiny random Qwen2 (2 layers, hidden 64) with SmolLM2's tokenizer: fast engines whose sampled
    output is close to uniform noise (the structured-output tests use it as an adversarial sampler)."""
    from testkit.tp_cases import save_tiny_qwen2

    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), smollm2_path, eos_token_id=2)


@pytest.fixture(scope="module")
def loop():
    """One asyncio loop per module, for the tests that run worker servers in this process."""
    import asyncio

    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
