"""Greedy output equals HF transformers generate(), token for token, on every scheduling path:
one request at a time, all together (continuous batching), tiny chunks (multi-step prefill),
shared prefixes (prefix-cache hits) and a tiny KV pool (preemption and recompute)."""

from __future__ import annotations

from pathlib import Path


from workers.llm import LLM
from workers.sampling_params import SamplingParams

from testkit.greedy import NEW_TOKENS, PROMPTS, check

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_one_at_a_time(llm, tokenizer, hf_greedy):
    check([llm.generate(p, GREEDY)[0] for p in PROMPTS], tokenizer, hf_greedy)


def test_all_together(llm, tokenizer, hf_greedy):
    check(llm.generate(PROMPTS, GREEDY), tokenizer, hf_greedy)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_tiny_chunks_force_multi_step_prefill(smollm2_path: Path, tokenizer, hf_greedy):
    small = LLM(
        str(smollm2_path), kv_cache_memory_bytes=32 << 20, block_size=4, max_num_batched_tokens=5, max_num_seqs=4
    )
    check(small.generate(PROMPTS, GREEDY), tokenizer, hf_greedy)


def test_shared_prefix_hits_prefix_cache(llm, tokenizer, hf_greedy):
    system = (
        "<|im_start|>system\nYou are a concise assistant who answers questions about geography, "
        "history and science in one sentence.<|im_end|>\n<|im_start|>user\n"
    )
    questions = ["Where is Peru?", "Who built the pyramids?", "What is photosynthesis?"]
    prompts = [f"{system}{q}<|im_end|>\n<|im_start|>assistant\n" for q in questions]
    first = llm.generate(prompts[0], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    system_tokens = len(tokenizer.encode(system))
    block = llm.engine.block_manager.block_size
    for prompt, out in zip(prompts, [first, *rest]):
        assert out.token_ids == hf_greedy(tokenizer.encode(prompt))
    for out in rest:
        assert out.num_cached_tokens >= (system_tokens // block) * block > 0


def test_preemption_and_recompute(smollm2_path: Path, tokenizer, hf_greedy):
    # 12 blocks x 16 = 192 token slots for 8 requests of ~10-25 + 32 tokens: must preempt.
    tight = LLM(str(smollm2_path), num_blocks=12, block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    outs = tight.generate(PROMPTS, GREEDY)
    check(outs, tokenizer, hf_greedy)
    engine = tight.engine
    assert engine.block_manager.num_free_blocks == 12
    assert engine.stats().num_preemptions > 0


def test_plain_torch_path_matches_kernels(llm, tokenizer, hf_greedy):
    """The C++ kernels are an optimisation: the torch reference path must give the same tokens."""
    from kernels import cpu_kernels_available, set_cpu_kernels_enabled

    assert cpu_kernels_available()
    previous = set_cpu_kernels_enabled(False)
    try:
        check(llm.generate(PROMPTS, GREEDY), tokenizer, hf_greedy)
    finally:
        set_cpu_kernels_enabled(previous)


def test_engine_config_turns_the_kernels_off(smollm2_path: Path):
    """EngineConfig.cpu_kernels=False (pools[].engine.cpu_kernels; DUET_DISABLE_CPU_KERNELS=1 at the
    CLI edge) puts the engine's process on the torch references, which give the kernels' tokens."""
    from kernels import cpu_kernels_enabled, set_cpu_kernels_enabled

    previous = cpu_kernels_enabled()
    short = SamplingParams(temperature=0.0, max_tokens=6)
    try:
        llm = LLM(str(smollm2_path), cpu_kernels=False, fused_decode=False, kv_cache_memory_bytes=16 << 20,
                  enable_prefix_caching=False)
        assert not cpu_kernels_enabled() and llm.engine.runner.model.fused_decode is False
        plain = [o.token_ids for o in llm.generate(PROMPTS[:2], short)]
        set_cpu_kernels_enabled(True)
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], short)] == plain
    finally:
        set_cpu_kernels_enabled(previous)
