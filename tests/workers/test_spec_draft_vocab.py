"""The drafter's vocabulary-pruned head (workers/spec_decode/draft_vocab.py): which tokens it keeps,
that it scores them exactly as the full head does, that drafts never leave the set, and that
speculative output with a pruned drafter is still plain greedy output token for token (and seeded
sampling still reproduces)."""

from __future__ import annotations

import json

import pytest
import torch

from workers.config import CacheConfig, EngineConfig, SpeculativeConfig
from workers.errors import ConfigError
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.draft_vocab import PrunedHead, draft_token_ids, frequency_order
from workers.spec_decode.drafter import DraftEngine, DraftItem
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

from test_spec_decode_engine import SPEC_PROMPTS, greedy, make, run

KEEP = 2048  # of SmolLM2's 49152


def test_frequency_order_follows_merge_ranks_and_keeps_added_tokens(smollm2_path):
    tj = json.loads((smollm2_path / "tokenizer.json").read_text())
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    added, rest = frequency_order(smollm2_path, 49152)
    assert added == sorted(t["id"] for t in tj["added_tokens"])
    assert sorted(added + rest) == list(range(49152))  # every id once
    first_merge = vocab["".join(merges[0])]  # "Ġt": the most frequent pair in the tokenizer's corpus
    later_merge = vocab["".join(merges[5000])]
    assert rest.index(first_merge) < rest.index(later_merge)
    ids = draft_token_ids(smollm2_path, 49152, KEEP)
    assert len(ids) == KEEP and torch.equal(ids, ids.sort().values) and set(added) <= set(ids.tolist())


def test_frequency_order_without_a_tokenizer_keeps_the_lowest_ids(tmp_path):
    added, rest = frequency_order(tmp_path, 100)
    assert added == [] and rest == list(range(100))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_pruned_head_scores_its_tokens_like_the_full_head(smollm2_path, quantization):
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization=quantization,
                                      cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))
    model = engine.runner.model
    ids = draft_token_ids(smollm2_path, engine.vocab_size, KEEP)
    head = PrunedHead(model, ids, quantization)
    hidden = torch.randn(3, engine.spec.hidden_size)  # [N, E]
    with torch.inference_mode():
        full, pruned = model.compute_logits(hidden), head(hidden)  # [N, V], [N, P]
    torch.testing.assert_close(pruned, full[:, ids], rtol=1e-4, atol=1e-4)
    expanded = head.full_logits(pruned, engine.vocab_size)  # [N, V]
    assert torch.isinf(expanded).sum() == 3 * (engine.vocab_size - KEEP)
    assert torch.equal(expanded[:, ids], pruned)


@pytest.fixture(scope="module")
def pruned_drafter(smollm2_path):
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)), draft_vocab_size=KEEP)
    server, endpoint = serve_drafter(engine)
    yield engine, endpoint
    server.stop(grace=0)


def test_pruned_drafts_stay_in_the_kept_set(pruned_drafter, smollm2_path):
    engine, _ = pruned_drafter
    kept = set(engine.head.ids.tolist())
    items = [DraftItem(f"v{i}", 0, list(range(100 + 50 * i, 130 + 50 * i)), 6, p)
             for i, p in enumerate([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)])]
    greedy_res, sampled_res = engine.propose(items)
    for res in (greedy_res, sampled_res):
        assert len(res.token_ids) == 6 and set(res.token_ids) <= kept
        engine.release(res.request_id)
    q = torch.stack(sampled_res.probs)  # [K, V]: no mass outside the kept ids
    assert q.shape[1] == engine.vocab_size and q[:, sorted(kept)].sum(-1).sub(1).abs().max() < 1e-5
    assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _with_pruned(path, endpoint, overlap=True):
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=4, overlap=overlap,
                             adaptive=False, draft_vocab_size=KEEP)
    return make(path, speculative=spec, proposer=DraftModelProposer(endpoint_connector(endpoint), overlap=overlap))


def test_pruned_drafter_greedy_equals_plain(smollm2_path, pruned_drafter):
    _, endpoint = pruned_drafter
    plain, llm = make(smollm2_path), _with_pruned(smollm2_path, endpoint)
    for batch in (1, 8):
        prompts = SPEC_PROMPTS[:batch]
        params = [greedy(20 + 5 * i) for i in range(batch)]
        assert run(llm, prompts, params) == run(plain, prompts, params)
    s = llm.engine.stats().spec
    assert s.num_verifies > 0 and s.num_accepted_tokens > 0 and s.num_fallbacks == 0
    llm.engine.speculator.close()


def test_pruned_drafter_sampled_requests_reproduce(smollm2_path, pruned_drafter):
    _, endpoint = pruned_drafter
    llm = _with_pruned(smollm2_path, endpoint, overlap=False)
    params = [SamplingParams(temperature=0.8, seed=21 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    first = run(llm, SPEC_PROMPTS[:3], params)
    assert run(llm, SPEC_PROMPTS[:3], params) == first
    assert llm.engine.stats().spec.num_verifies > 0
    llm.engine.speculator.close()


@pytest.mark.parametrize("field,value", [("draft_vocab_size", 100), ("draft_vocab_size", -1), ("drafter_threads", -2)])
def test_bad_drafter_settings_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig(method="ngram", **{field: value})
