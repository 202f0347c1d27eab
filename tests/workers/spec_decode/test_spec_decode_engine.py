"""Speculative decoding end to end in the engine: greedy output equals plain greedy output token for
token (batch sizes 1-16, mixed lengths, each proposer, prefix-cache hits, small blocks so rollback
crosses block boundaries, a tight KV pool), seeded sampling reproduces, per-request opt-out works,
and nothing leaks (KV blocks on the target and on the drafter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.config import SpeculativeConfig
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.spec_decode.draft_model import DraftModelProposer
from workers.spec_decode.drafter import DraftEngine
from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

from testkit.greedy import PROMPTS
from testkit.tolerance import LOGPROB_ACROSS_BATCHES

# Repetitive and code prompts (where drafts get accepted) next to the shared ones (where few are).
SPEC_PROMPTS = PROMPTS + [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat exactly: red green blue red green blue red green blue red green",
    "<|im_start|>user\nCopy this list: apples, pears, plums, apples, pears, plums<|im_end|>\n<|im_start|>assistant\n",
]
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=5)


def make(path: Path, **kw) -> LLM:
    kw = {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 128, **kw}
    return LLM(str(path), **kw)


def greedy(n: int = 40, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = [c.token_ids for c in llm.generate(prompts, params)]
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return outs


@pytest.fixture(scope="module")
def plain(smollm2_path):
    return make(smollm2_path)


@pytest.fixture(scope="module")
def ngram(smollm2_path):
    return make(smollm2_path, speculative=NGRAM)


@pytest.fixture(scope="module")
def drafter(smollm2_path):
    """An int8 SmolLM2 drafting for the fp32 one, served over gRPC in this process (the Ray actor
    around the same service is tested in test_spec_drafter_actor.py)."""
    engine = DraftEngine(_draft_config(smollm2_path))
    server, endpoint = serve_drafter(engine)
    yield engine, endpoint
    server.stop(grace=0)


def _draft_config(path):
    from workers.config import CacheConfig, EngineConfig

    return EngineConfig(model=str(path), quantization="int8", cache=CacheConfig(kv_cache_memory_bytes=16 << 20))


def with_drafter(path, endpoint, overlap=True, **kw) -> LLM:
    # adaptive off: an int8 drafter of the same size as the target is rightly judged not worth it on
    # a quiet machine, and these tests need drafts to verify
    spec = SpeculativeConfig(method="draft_model", draft_model=str(path), num_speculative_tokens=4, overlap=overlap,
                             adaptive=False)
    return make(path, speculative=spec, proposer=DraftModelProposer(endpoint_connector(endpoint), overlap=overlap),
                **kw)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_ngram_greedy_equals_plain(plain, ngram, batch):
    prompts = (SPEC_PROMPTS * 2)[:batch]
    lengths = [12 + 2 * i for i in range(batch)]  # mixed lengths: requests finish at different steps
    params = [greedy(n) for n in lengths]
    assert run(ngram, prompts, params) == run(plain, prompts, params)


def test_ngram_drafts_are_accepted_on_repetitive_text(ngram):
    before = ngram.engine.stats().spec
    run(ngram, [SPEC_PROMPTS[-1]], [greedy(48)])  # SmolLM2 repeats the fruit list
    after = ngram.engine.stats().spec
    assert after.method == "ngram"
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 8
    assert after.num_emitted_tokens > after.num_verifies  # more than one token per verify on average


def test_ngram_with_prefix_cache_hits_small_blocks_and_a_tight_pool(smollm2_path, plain):
    """block_size 4: rejected drafts' blocks are trimmed at block boundaries; 40 blocks for 8
    requests forces preemption (drafts are dropped for preempted requests, never the cause)."""
    shared = "You are a careful assistant. Answer briefly and repeat key words. " * 3
    prompts = [shared + p for p in SPEC_PROMPTS[:8]]
    params = [greedy(24 + 3 * i) for i in range(8)]
    want = run(plain, prompts, params)
    # adaptive off: the adaptive draft length follows measured step times, so on a loaded machine it
    # may stop drafting, and without draft slots the pool is no longer tight
    always = SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False)
    small = make(smollm2_path, speculative=always, block_size=4, num_blocks=70, max_num_batched_tokens=64)
    assert run(small, prompts, params) == want
    assert run(small, prompts, params) == want  # again, now with prefix-cache hits
    assert small.engine.block_manager.stats().prefix_cache_hits > 0
    assert small.engine.stats().num_preemptions > 0


def test_draft_model_greedy_equals_plain(smollm2_path, plain, drafter):
    engine, endpoint = drafter
    llm = with_drafter(smollm2_path, endpoint)
    for batch in (1, 8):
        prompts = SPEC_PROMPTS[:batch]
        params = [greedy(20 + 5 * i) for i in range(batch)]
        assert run(llm, prompts, params) == run(plain, prompts, params)
    s = llm.engine.stats().spec
    assert s.method == "draft_model" and s.num_verifies > 0 and s.num_accepted_tokens > 0
    assert s.num_fallbacks == 0
    llm.engine.speculator.close()


def test_draft_model_without_overlap_and_sampled_requests_reproduce(smollm2_path, drafter):
    engine, endpoint = drafter
    llm = with_drafter(smollm2_path, endpoint, overlap=False)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=24, ignore_eos=True)
              for i in range(3)]
    first = run(llm, SPEC_PROMPTS[:3], params)
    assert run(llm, SPEC_PROMPTS[:3], params) == first
    assert llm.engine.stats().spec.num_verifies > 0
    llm.engine.speculator.close()


def test_ngram_sampled_requests_reproduce(ngram):
    params = [SamplingParams(temperature=0.7, seed=3 + i, max_tokens=32, ignore_eos=True) for i in range(4)]
    assert run(ngram, SPEC_PROMPTS[-4:], params) == run(ngram, SPEC_PROMPTS[-4:], params)


def test_per_request_opt_out(ngram):
    before = ngram.engine.stats().spec.num_verifies
    run(ngram, [SPEC_PROMPTS[-1]], [greedy(32, num_speculative_tokens=0)])
    assert ngram.engine.stats().spec.num_verifies == before


def test_stop_inside_an_accepted_window(plain, ngram):
    """A stop token id reached among accepted drafts ends the request there, like plain decoding."""
    prompt = SPEC_PROMPTS[-1]
    [ref] = run(plain, [prompt], [greedy(40)])
    stop = ref[12]
    params = greedy(40, stop_token_ids=(stop,))
    assert run(ngram, [prompt], [params]) == run(plain, [prompt], [params])


def test_drafter_releases_finished_requests(smollm2_path, drafter):
    import time

    engine, endpoint = drafter
    llm = with_drafter(smollm2_path, endpoint)
    run(llm, SPEC_PROMPTS[:4], [greedy(16)] * 4)
    llm.engine.speculator.close()
    deadline = time.monotonic() + 10
    while engine.num_requests and time.monotonic() < deadline:  # Release is sent without waiting
        time.sleep(0.05)
    assert engine.num_requests == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ------------------------------------------------------------- penalties and logprobs
def _penalised(n: int, **kw) -> SamplingParams:
    """Mild penalties (drafts still get accepted on repetitive text), bias, min_tokens, logprobs."""
    return greedy(n, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, logit_bias={13: 0.5},
                  min_tokens=4, top_logprobs=2, **kw)


def run_lp(llm: LLM, prompts, params) -> tuple[list[list[int]], list[list[tuple[int, float]]]]:
    outs = llm.generate(prompts, params)
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"
    return [c.token_ids for c in outs], [[(lp.token_id, lp.logprob) for lp in c.logprobs] for c in outs]


def _assert_same(got, want) -> None:
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):  # logprobs are the target's, position by position
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [v for _, v in g] == LOGPROB_ACROSS_BATCHES.approx([v for _, v in w])


def test_ngram_greedy_with_penalties_equals_plain(plain, ngram):
    """Verification processes each position with the drafts before it counted as generated."""
    prompts = SPEC_PROMPTS[-4:]
    params = [_penalised(24 + 4 * i) for i in range(4)]
    before = ngram.engine.stats().spec.num_accepted_tokens
    _assert_same(run_lp(ngram, prompts, params), run_lp(plain, prompts, params))
    assert ngram.engine.stats().spec.num_accepted_tokens > before  # drafts were really verified


def test_ngram_sampled_with_penalties_reproduces(ngram):
    params = [SamplingParams(temperature=0.8, seed=21 + i, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                             repetition_penalty=1.2, min_p=0.05, top_logprobs=1) for i in range(3)]
    assert run_lp(ngram, SPEC_PROMPTS[-3:], params) == run_lp(ngram, SPEC_PROMPTS[-3:], params)


def test_draft_model_greedy_with_penalties_equals_plain(smollm2_path, plain, drafter):
    engine, endpoint = drafter
    llm = with_drafter(smollm2_path, endpoint)
    prompts = SPEC_PROMPTS[-4:]
    params = [_penalised(20 + 4 * i) for i in range(4)]
    _assert_same(run_lp(llm, prompts, params), run_lp(plain, prompts, params))
    assert llm.engine.stats().spec.num_verifies > 0
    llm.engine.speculator.close()


def _decode(llm: LLM, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    llm.engine.add_request(rid, prompt, params)
    out: list[int] = []
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            out += o.new_token_ids
    return out


def test_a_new_requests_prompt_is_prefetched_onto_its_drafter(smollm2_path, plain, drafter):
    """A request added to the target is sent to its drafter at once (a prefetch), so the drafter
    computes the prompt while the target prefills it, not in the first draft round while the target's
    batch waits; output = plain greedy. A request that asks for no speculation sends nothing."""
    import time

    engine, endpoint = drafter
    llm = with_drafter(smollm2_path, endpoint)
    prompt = [100 + (7 * i) % 900 for i in range(40)]
    items, computed = engine.stats().items, engine.stats().tokens_computed
    llm.engine.add_request("pre", prompt, greedy(24))  # not stepped yet
    deadline = time.monotonic() + 30
    while engine.stats().tokens_computed - computed < len(prompt) - 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    # a prefetch computes the prompt but its last token (the first round computes it with the next)
    assert engine.stats().items - items == 1 and engine.stats().tokens_computed - computed == len(prompt) - 1
    out: list[int] = []
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            out += o.new_token_ids
    assert out == _decode(plain, "pre", prompt, greedy(24))
    assert llm.engine.stats().spec.num_verifies > 0
    items = engine.stats().items
    assert _decode(llm, "off", prompt, greedy(8, num_speculative_tokens=0)) == _decode(plain, "off", prompt, greedy(8))
    assert engine.stats().items == items  # no prefetch, no round
    llm.engine.speculator.close()
