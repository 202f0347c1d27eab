"""cache.kv_cache_dtype: a bf16 KV cache under float32 activations (the CPU default for int8 / q4).

- the setting is checked at the edge with messages naming the key (a float32 cache under bf16
  activations, a mixed cache on CUDA, an unknown value), and 'auto' resolves to bf16 only for a
  quantized model on CPU;
- the cache really is bf16 and holds twice the blocks in the same byte budget;
- the C++ kernels over a bf16 cache give the torch references' tokens (the optimisation against
  the plain path) for an fp32 model with an explicit bf16 cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.config import CacheConfig, EngineConfig
from workers.errors import ConfigError
from workers.llm import LLM
from workers.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3575, 282, 4649, 314, 253], [1, 9690, 314, 253, 1345, 282, 8297, 30, 378, 2910, 28, 744]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _config(**kw) -> EngineConfig:
    cache = CacheConfig(kv_cache_dtype=kw.pop("kv", "auto"))
    return EngineConfig(model="m", cache=cache, **kw)


def test_invalid_combinations_name_the_key() -> None:
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype='float16'"):
        CacheConfig(kv_cache_dtype="float16")
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype='float32' with dtype='bfloat16'"):
        _config(kv="float32", dtype="bfloat16")
    with pytest.raises(ConfigError, match="on device='cuda'"):
        _config(kv="bfloat16", dtype="float32", device="cuda")
    _config(kv="bfloat16", dtype="bfloat16", device="cuda")  # the activations' own dtype is always fine
    _config(kv="bfloat16", dtype="auto")  # checked again once dtype is resolved


@pytest.mark.parametrize("quantization,dtype,device,kv,want", [
    ("q4", "float32", "cpu", "auto", torch.bfloat16),
    ("int8", "float32", "cpu", "auto", torch.bfloat16),
    ("q4", "float32", "cuda", "auto", torch.float32),
    ("none", "float32", "cpu", "auto", torch.float32),
    ("none", "bfloat16", "cpu", "auto", torch.bfloat16),
    ("q4", "float32", "cpu", "float32", torch.float32),
    ("none", "float32", "cpu", "bfloat16", torch.bfloat16),
])
def test_auto_is_bf16_for_quantized_models_on_cpu(quantization, dtype, device, kv, want) -> None:
    assert _config(kv=kv, dtype=dtype, device=device, quantization=quantization).kv_dtype is want


def test_a_bf16_cache_holds_twice_the_blocks(smollm2_path: Path) -> None:
    budget = 16 << 20
    bf = LLM(str(smollm2_path), quantization="q4", kv_cache_memory_bytes=budget)
    fp = LLM(str(smollm2_path), quantization="q4", kv_cache_memory_bytes=budget, kv_cache_dtype="float32")
    assert bf.engine.runner.kv_cache.dtype is torch.bfloat16 and fp.engine.runner.kv_cache.dtype is torch.float32
    n_bf, n_fp = bf.engine.block_manager.num_blocks, fp.engine.block_manager.num_blocks
    assert 2 * n_fp <= n_bf <= 2 * n_fp + 1  # half the bytes per block (the budget divided down, so +1 at most)
    assert bf.engine.runner.kv_layout().dtype is torch.bfloat16  # what handoff, tiers and fingerprints see


def test_kernels_over_a_bf16_cache_give_the_references_tokens(smollm2_path: Path) -> None:
    """An fp32 model (continuous activations). A q4 / int8 model's kernel and reference attention
    differ by float rounding (~1e-7) that its int8 activation codes can turn into a different token
    at a near-tie, with an fp32 cache as with a bf16 one; for those the fused stack's bit-identity
    (tests/workers/models/test_decode_stack.py) and the kernel tests cover the bf16 cache."""
    from kernels import set_cpu_kernels_enabled

    llm = LLM(str(smollm2_path), dtype="float32", kv_cache_dtype="bfloat16",
              kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    assert llm.engine.runner.kv_cache.dtype is torch.bfloat16
    fast = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    previous = set_cpu_kernels_enabled(False)  # every op on its torch reference (the fused stack too)
    try:
        plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        set_cpu_kernels_enabled(previous)
    assert fast == plain
