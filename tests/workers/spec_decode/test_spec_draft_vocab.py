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
from workers.spec_decode.draft_vocab import ContextVocab, PrunedHead, draft_token_ids, expand, frequency_order
from workers.spec_decode.drafter import DraftEngine, DraftItem
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

from test_spec_decode_engine import SPEC_PROMPTS, greedy, make, run

from testkit.tolerance import MODEL_FP32, PROB_MASS_FP32

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


def test_frequency_order_without_a_usable_tokenizer_keeps_the_lowest_ids(tmp_path):
    assert frequency_order(tmp_path, 100) == ([], list(range(100)))  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # no vocab
    assert frequency_order(tmp_path, 100) == ([], list(range(100)))
    (tmp_path / "tokenizer.json").write_text('{"added_tokens": [{"id": 3}], "model": {"type": "WordPiece"}}')
    assert frequency_order(tmp_path, 10) == ([3], [0, 1, 2, 4, 5, 6, 7, 8, 9])


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
    MODEL_FP32.assert_close(pruned, full[:, ids])
    expanded = expand(ids, pruned[0], engine.vocab_size)  # [V]
    assert torch.isinf(expanded).sum() == engine.vocab_size - KEEP and torch.equal(expanded[ids], pruned[0])


@pytest.fixture(scope="module")
def pruned_drafter(smollm2_path):
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)), draft_vocab_size=KEEP)
    server, endpoint = serve_drafter(engine)
    yield engine, endpoint
    server.stop(grace=0)


def test_context_vocab_adds_the_requests_rare_tokens(smollm2_path):
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="none",
                                      cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))
    head = PrunedHead(engine.runner.model, draft_token_ids(smollm2_path, engine.vocab_size, KEEP), "none")
    kept = set(head.ids.tolist())
    rare = [t for t in range(40000, 40010) if t not in kept]
    ctx = ContextVocab(head)
    ctx.update([5, rare[0], 6, rare[1], rare[0]])
    assert ctx.ids == rare[:2]
    ctx.rewind(2)  # a rollback to [5, rare0]; then the target's own rare token
    ctx.update([5, rare[0], rare[2]])
    assert ctx.ids == rare[:3]
    emb = engine.runner.model.model.embed_tokens.weight  # SmolLM2 ties its head to the embedding
    assert torch.equal(ctx.weight, emb[rare[:3]])
    hidden = torch.randn(2, engine.spec.hidden_size)
    with torch.inference_mode():
        (ids0, lg0), (ids1, lg1) = head.score(hidden, [ctx, ContextVocab(head)])
    assert ids0.tolist() == head.ids.tolist() + rare[:3] and torch.equal(ids1, head.ids)
    MODEL_FP32.assert_close(lg0, engine.runner.model.compute_logits(hidden[:1])[0, ids0])


def test_pruned_drafts_stay_in_the_kept_set_and_the_context(smollm2_path):
    # an engine of its own: the fixture's is driven by its server's scheduler thread (one thread per engine)
    engine = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                      cache=CacheConfig(kv_cache_memory_bytes=16 << 20)), draft_vocab_size=KEEP)
    kept = set(engine.head.ids.tolist())
    prompts = [list(range(100 + 50 * i, 130 + 50 * i)) + [40001 + i] for i in range(2)]  # one rare token each
    items = [DraftItem(f"v{i}", 0, prompts[i], 6, p)
             for i, p in enumerate([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)])]
    greedy_res, sampled_res = engine.propose(items)
    for res, prompt in zip((greedy_res, sampled_res), prompts):
        assert len(res.token_ids) == 6 and set(res.token_ids) <= kept | set(prompt)
        engine.release(res.request_id)
    q = torch.stack(sampled_res.probs)  # [K, V]: no mass outside the kept ids and the context's
    assert q.shape[1] == engine.vocab_size
    PROB_MASS_FP32.assert_close(q[:, sorted(kept | set(prompts[1]))].sum(-1), torch.ones(len(q)))
    assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine._vocabs


def _with_pruned(path, endpoint, overlap=True):
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=4, overlap=overlap,
                             adaptive=False, draft_vocab_size=KEEP)
    # a generous call timeout: the test is about the pruned drafter's tokens, and a drafter call
    # slowed past the 2 s default on a loaded machine would fall back and skip the drafts checked here
    return make(path, speculative=spec, proposer=DraftModelProposer(endpoint_connector(endpoint), timeout_s=30.0,
                                                                    overlap=overlap))


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
