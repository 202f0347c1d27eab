"""Shared prompts of the engine tests (English, code, non-English, chat format) and the check that an
engine's greedy completions equal HF transformers' ``generate`` (the ``hf_greedy`` fixture of
tests/workers/conftest.py), token for token."""

from __future__ import annotations

from collections.abc import Callable

from workers.llm import Completion

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Explain quantum computing in simple terms.",
    "1, 2, 3, 4, 5,",
    "Translate to German: The weather is nice today.",
    "Les fleurs du jardin sont",  # non-English
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",  # chat format
]
NEW_TOKENS = 32


def check(outs: list[Completion], tokenizer, hf_greedy: Callable[[list[int]], list[int]]) -> None:
    """Each completion (in PROMPTS order) equals HF's greedy continuation and ended by stop or length."""
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(tokenizer.encode(prompt))
        assert out.token_ids == ref, f"prompt {prompt!r}"
        assert out.finish_reason.value in ("stop", "length")
