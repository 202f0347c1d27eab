"""Sliding-window block release (workers/engine/scheduler.py, BlockManager.release_leading) on a tiny
Mistral whose every layer slides: a long generation holds only the blocks of its window, gives the
same greedy tokens as the engine that keeps every block (and as transformers), and leaks nothing.
A prefill-only request keeps its blocks for the export, so a decode side that prefix-caches the
imported blocks serves a later request from valid KV. Mixed sliding/full models release nothing."""

from __future__ import annotations

import pytest

from tests.workers.models.conftest import hf_generate, save_tiny
from tests.workers.engine.test_disagg_engine import disagg_run
from workers.engine.block_manager import BlockManager
from workers.engine.engine import Engine
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler

WINDOW, BS = 8, 4
PROMPT = list(range(100, 130))  # 30 tokens: longer than the window, several chunks
SHARED = PROMPT[:20] + [7, 8, 9]  # shares 5 blocks with PROMPT (prefix cache after release)
NEW = 24
KW = dict(kv_cache_memory_bytes=4 << 20, block_size=BS, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_path):
    return save_tiny(tmp_path_factory.mktemp("mistral"), smollm2_path, "mistral", head_dim=16, sliding_window=WINDOW)


def run(engine: Engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt (run one after the other, so later ones hit the prefix cache)
    and the most blocks held at once."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    results, peak = [], 0
    for prompt in prompts:
        rid = engine.add_request(None, prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.request_id == rid
                tokens += out.new_token_ids
            bm = engine.block_manager
            peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        results.append(tokens)
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "every block is back in the pool"
    return results, peak


def test_release_keeps_tokens_and_holds_only_the_window(mistral):
    llm = LLM(str(mistral), **KW)
    engine = llm.engine
    assert engine.scheduler.window == WINDOW
    released, peak = run(engine, [PROMPT, SHARED], NEW)
    assert engine.block_manager.stats().prefix_cache_hits >= 5, "released blocks stay prefix-cached"
    bm = BlockManager(engine.runner.num_blocks, BS)
    plain = Engine(engine.config, engine.runner, llm.tokenizer, block_manager=bm,
                   scheduler=Scheduler(engine.config.scheduler, bm, window=None))
    kept, plain_peak = run(plain, [PROMPT, SHARED], NEW)
    assert released == kept  # (tests/workers/models/test_architectures.py: mistral equals transformers)
    # The plain engine holds the whole context (but the last sampled token); the releasing one the
    # blocks of the next query's window (<= WINDOW // BS + 1) and of a prefill chunk (16 tokens)
    assert plain_peak >= (len(PROMPT) + NEW - 2) // BS
    assert peak <= (WINDOW + KW["max_num_batched_tokens"]) // BS + 1 < plain_peak


def test_exported_prompt_keeps_its_blocks(mistral):
    """Disaggregated: the prefill side must not release blocks it will export (the decode side
    prefix-caches them); a later colocated request on the decode side hitting them stays exact."""
    prefill, decode = LLM(str(mistral), **KW).engine, LLM(str(mistral), **KW).engine
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    tokens, _ = disagg_run(prefill, decode, [PROMPT], params)
    assert tokens == [hf_generate(mistral, PROMPT, 6)]
    again, _ = run(decode, [SHARED], 6)
    assert decode.block_manager.stats().prefix_cache_hits >= 5
    assert again == [hf_generate(mistral, SHARED, 6)]


@pytest.mark.parametrize("arch, overrides, releasable", [
    ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention"]), None),
    ("qwen3", dict(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"]), None),
    ("qwen3", dict(use_sliding_window=True, layer_types=["sliding_attention", "sliding_attention"]), WINDOW),
    ("mistral", {}, WINDOW),
    ("phi3", {}, WINDOW),
])
def test_only_models_whose_every_layer_slides_release(arch, overrides, releasable):
    from transformers import AutoConfig

    from tests.workers.models.conftest import TINY
    from workers.models.config import ModelSpec

    spec = ModelSpec.from_hf_config(AutoConfig.for_model(arch, **{**TINY, "sliding_window": WINDOW, **overrides}))
    assert spec.sliding_window == WINDOW and spec.releasable_window == releasable
