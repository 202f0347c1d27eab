"""The sampling surface end to end in the engine (SmolLM2): logprobs of greedy tokens equal an
independent HF transformers forward pass; greedy decoding with each penalty equals a reference
decoding loop over HF logits with the penalty written out; logit_bias and min_tokens act as
defined; seeded requests with penalties reproduce whatever else is in the batch; chunked prefill
and prefix caching do not change penalised output; nothing leaks."""

from __future__ import annotations

import math

import pytest
import torch

from workers.llm import LLM
from workers.sampling_params import SamplingParams

from testkit.greedy import PROMPTS
from testkit.tolerance import LOGPROB_ACROSS_BATCHES, LOGPROB_VS_HF

N = 12


@pytest.fixture(scope="module")
def hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def _reference_greedy(hf, prompt: list[int], n: int, p: SamplingParams, eos: int) -> list[int]:
    """Greedy decoding with the penalties applied by their definitions, one token at a time."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        l = _hf_logits(hf, ids)[-1].clone()  # [V]
        for t in set(ids):
            l[t] = l[t] / p.repetition_penalty if l[t] > 0 else l[t] * p.repetition_penalty
        for t in set(out):
            l[t] -= p.presence_penalty + p.frequency_penalty * out.count(t)
        for t, b in p.logit_bias:
            l[t] += b
        if len(out) < p.min_tokens:
            l[eos] = -math.inf
        tok = int(l.argmax())
        out.append(tok)
        ids.append(tok)
    return out


def _free(llm: LLM) -> None:
    stats = llm.engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "KV blocks leaked"


def test_greedy_logprobs_equal_hf_log_softmax(engine, hf, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, top_logprobs=5, ignore_eos=True))
    for prompt, c in zip(prompts, outs):
        assert len(c.logprobs) == len(c.token_ids) == N
        ref = torch.log_softmax(_hf_logits(hf, prompt + c.token_ids[:-1])[len(prompt) - 1 :], -1)  # [N, V]
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lp.token_id == tok
            assert lp.logprob == LOGPROB_VS_HF.approx(float(ref[i, tok]))
            want = ref[i].topk(5)
            assert [t for t, _ in lp.top][:1] == want.indices.tolist()[:1] == [tok]  # greedy: the top one
            LOGPROB_VS_HF.assert_close(torch.tensor([v for _, v in lp.top]), want.values)
    _free(engine)


@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=1.5),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=1.0),
    dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={13: 3.0}),
], ids=["repetition", "presence", "frequency", "all"])
def test_greedy_with_penalties_equals_the_reference(engine, hf, tokenizer, kwargs):
    prompt = tokenizer.encode(PROMPTS[2])  # each penalty changes its greedy continuation
    p = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kwargs)
    [c] = engine.generate([prompt], p)
    assert c.token_ids == _reference_greedy(hf, prompt, N, p, tokenizer.eos_token_id)
    [plain] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    assert c.token_ids != plain.token_ids  # the penalty changed something on this repetitive prompt
    _free(engine)


def test_logit_bias_forces_and_bans(engine, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    [plain] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    [forced] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={42: 100.0}))
    assert forced.token_ids == [42] * 4
    [banned] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                        logit_bias={plain.token_ids[0]: -100.0}))
    assert banned.token_ids[0] != plain.token_ids[0]


def test_min_tokens_masks_eos_and_stop_ids(engine, tokenizer):
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(PROMPTS[7])  # a chat turn: the model soon wants to end it
    [short] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))
    assert short.token_ids[-1] == eos and len(short.token_ids) < 40
    want = len(short.token_ids) + 5
    [longer] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, min_tokens=want,
                                                        top_logprobs=0))
    assert len(longer.token_ids) >= want and eos not in longer.token_ids[: want - 1]
    assert all(lp.logprob > -math.inf for lp in longer.logprobs)
    _free(engine)


def test_seeded_penalised_sampling_reproduces_in_any_batch(engine, tokenizer):
    p = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, seed=11, max_tokens=N, presence_penalty=0.7,
                       repetition_penalty=1.1, top_logprobs=2)
    prompt = tokenizer.encode(PROMPTS[2])
    [alone] = engine.generate([prompt], p)
    crowd = engine.generate([tokenizer.encode(x) for x in PROMPTS[:4]] + [prompt],
                            [SamplingParams(temperature=1.0, max_tokens=N)] * 4 + [p])
    assert crowd[-1].token_ids == alone.token_ids
    assert [lp.logprob for lp in crowd[-1].logprobs] == LOGPROB_ACROSS_BATCHES.approx([lp.logprob for lp in alone.logprobs])
    _free(engine)


def test_chunked_prefill_and_prefix_hits_keep_penalised_output(smollm2_path, engine, tokenizer):
    long_prompt = tokenizer.encode(" ".join(PROMPTS) * 2)  # several 64-token chunks
    p = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                       top_logprobs=1)
    [first] = engine.generate([long_prompt], p)
    [again] = engine.generate([long_prompt], p)  # prefix-cache hit now
    whole = LLM(str(smollm2_path), kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=2048,
                enable_prefix_caching=False)
    [unchunked] = whole.generate([long_prompt], p)
    assert first.token_ids == again.token_ids == unchunked.token_ids
    assert again.num_cached_tokens > 0
