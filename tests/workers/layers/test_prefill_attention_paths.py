"""Prefill attention has two paths (workers/layers/attention.py): kernels.varlen_paged_attention over
the paged cache (the default wherever a kernel exists) and the plain per-chunk SDPA path (gather +
offset causal mask). They must agree: layer outputs on a mixed step, and greedy tokens equal to HF
on the scheduling paths that exercise prefill with a cached prefix (tiny chunks, prefix-cache hits)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from workers.config import CacheConfig, EngineConfig
from workers.layers import attention as attention_mod
from workers.layers.attention import PagedAttention
from workers.llm import LLM
from workers.engine.model_runner import ModelRunner
from workers.models.config import ModelSpec
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledChunk

from testkit.greedy import NEW_TOKENS, PROMPTS, check
from testkit.tolerance import KERNEL_FP32

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture
def count_varlen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the varlen kernel path from the attention layer (the calls still run)."""
    calls: list[int] = []
    real = attention_mod.varlen_paged_attention

    def spy(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_mod, "varlen_paged_attention", spy)
    return calls


@pytest.fixture
def plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the plain SDPA prefill path (the other kernels stay on)."""
    monkeypatch.setattr(attention_mod, "varlen_kernel_available", lambda q: False)


def _spec(H: int, G: int, D: int) -> ModelSpec:
    return ModelSpec("llama", 10, H * D, 4, 1, H, G, D, 1e-5, 10000.0, None, 4096, True, False, False, (0,))


def test_layer_paths_agree_on_a_mixed_step(count_varlen: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Two decodes, a fresh prefill, and two chunks after cached prefixes (one not block aligned).
    H, G, D, bs = 9, 3, 64, 4
    spec = _spec(H, G, D)
    config = EngineConfig(cache=CacheConfig(block_size=bs, num_blocks=64))
    runner = ModelRunner(torch.nn.Identity(), spec, config, num_blocks=64)
    chunks = [
        ScheduledChunk("d0", [1], 9, list(range(0, 3)), True),
        ScheduledChunk("d1", [1], 4, list(range(3, 5)), True),
        ScheduledChunk("p0", [1] * 7, 0, list(range(5, 7)), True),
        ScheduledChunk("p1", [1] * 5, 8, list(range(7, 11)), False),
        ScheduledChunk("p2", [1] * 6, 13, list(range(11, 16)), True),
    ]
    _, _, meta, _ = runner._prepare(chunks, num_singles=2)
    T = 2 + 7 + 5 + 6
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, G, D, generator=g), torch.randn(T, G, D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    cache = torch.randn(2, 64 * bs, G, D, generator=g)  # stale contents stand for the cached prefixes
    layer = PagedAttention(H, G, D)

    def run() -> torch.Tensor:
        kc, vc = cache[0].clone(), cache[1].clone()
        return layer(q.clone(), k.clone(), v.clone(), cos, sin, kc, vc, meta)

    kernel_out = run()
    assert count_varlen == [T - 2]  # one call for all three prefill chunks
    monkeypatch.setattr(attention_mod, "varlen_kernel_available", lambda q: False)
    plain_out = run()
    assert count_varlen == [T - 2]  # the plain path did not call it
    KERNEL_FP32.assert_close(kernel_out, plain_out)


def test_kernel_path_matches_hf_tiny_chunks(smollm2_path: Path, tokenizer, hf_greedy, count_varlen) -> None:
    assert kernels.cpu_kernels_available()
    small = LLM(str(smollm2_path), kv_cache_memory_bytes=32 << 20, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    check(small.generate(PROMPTS, GREEDY), tokenizer, hf_greedy)
    assert count_varlen, "the varlen kernel path was not taken"


def test_plain_path_matches_hf_tiny_chunks(smollm2_path: Path, tokenizer, hf_greedy, plain_path, count_varlen) -> None:
    small = LLM(str(smollm2_path), kv_cache_memory_bytes=32 << 20, block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    check(small.generate(PROMPTS, GREEDY), tokenizer, hf_greedy)
    assert not count_varlen


def test_kernel_path_matches_hf_with_prefix_cache_hits(llm, tokenizer, hf_greedy, count_varlen) -> None:
    system = "<|im_start|>system\nYou answer in one short sentence about rivers and lakes.<|im_end|>\n<|im_start|>user\n"
    prompts = [f"{system}{q}<|im_end|>\n<|im_start|>assistant\n" for q in ("Where is the Nile?", "How deep is Baikal?")]
    outs = [llm.generate(p, GREEDY)[0] for p in prompts]
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tokenizer.encode(prompt))
    assert outs[1].num_cached_tokens > 0 and count_varlen
