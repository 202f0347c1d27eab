"""Fixtures for engine tests: HF transformers greedy references, the SmolLM2 tokenizer and a default engine
(the shared prompts and the greedy check are in tests/testkit/greedy.py); a tiny random Llama and
PEFT LoRA adapters on it (tests/workers/lora/, tests/workers/server/test_lora_service.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from testkit.greedy import NEW_TOKENS
from testkit.lora_cases import save_adapter
from testkit.tiny_families import save_tiny


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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_path: Path) -> Path:
    """A random Llama (2 layers, hidden 64, GQA 4/2) with SmolLM2's tokenizer."""
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"), smollm2_path, "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_llama: Path) -> dict[str, Path]:
    """Three adapters of the tiny Llama: every module at rank 8, q/v only at rank 4 with rslora,
    and the MLP only at rank 16 (the slots' max rank in the tests)."""
    root = tmp_path_factory.mktemp("tiny_adapters")
    return {
        "all8": save_adapter(tiny_llama, root / "all8", seed=1, r=8, alpha=16, b_std=0.3),
        "qv4": save_adapter(tiny_llama, root / "qv4", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj"],
                            rslora=True, b_std=0.3),
        "mlp16": save_adapter(tiny_llama, root / "mlp16", seed=3, r=16, alpha=32,
                              targets=["gate_proj", "up_proj", "down_proj"], b_std=0.3),
    }
