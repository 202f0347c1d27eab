"""Engine API: seeded sampling, stop conditions, bad input errors, abort frees blocks."""

from __future__ import annotations

import pytest

from workers.errors import InvalidRequestError, ModelNotFoundError
from workers.llm import LLM
from workers.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Write a short poem about the sea.", p)[0]
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=24) for s in (1, 2)]
    batched = llm.generate(["Hello there", "Write a short poem about the sea.", "Lists:"], [others[0], p, others[1]])
    assert batched[1].token_ids == alone.token_ids
    different = llm.generate("Write a short poem about the sea.", SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=4321, max_tokens=24, ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate("The tallest mountain is", SamplingParams(temperature=0, max_tokens=12))[0]
    topk1 = llm.generate("The tallest mountain is", SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=12))[0]
    assert topk1.token_ids == greedy.token_ids


def test_max_tokens_and_stop_token_ids(llm):
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH
    stop_at = out.token_ids[2]
    out2 = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_at]))[0]
    assert out2.token_ids == out.token_ids[: out.token_ids.index(stop_at) + 1]
    assert out2.finish_reason is FinishReason.STOP


def test_stop_string_cuts_text(llm):
    full = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert " 5" in full.text
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=16, stop=[" 5"]))[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(" 5")]


def test_eos_from_generation_config(llm):
    assert 2 in llm.engine.eos_token_ids  # <|im_end|> for SmolLM2-Instruct
    out = llm.generate("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n",
                       SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_bad_prompts_leave_engine_clean(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        llm.generate("", SamplingParams())
    limit = engine.max_model_len - 1
    with pytest.raises(InvalidRequestError, match=rf"prompt: {limit + 1} tokens; the limit is {limit}"):
        llm.generate([5] * (limit + 1), SamplingParams())
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([5, 10**6], SamplingParams())
    # a bad prompt in a batch rejects the batch and aborts the ones already queued
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], SamplingParams())
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == free


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "nope")):
        LLM(str(tmp_path / "nope"))


def test_abort_returns_all_blocks(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"abort-{i}", "A long story begins with a dragon and " * (i + 1), p)
    engine.add_request("keep", "Hello", SamplingParams(temperature=0, max_tokens=3))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < free
    outs = [engine.abort(f"abort-{i}") for i in range(4)]
    assert all(o.finished and o.finish_reason is FinishReason.ABORT for o in outs)
    assert engine.abort("abort-0") is None  # already gone
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == free


def test_warm_up_leaves_no_trace(llm):
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ref = llm.generate("Hello there", greedy)[0].token_ids
    before = engine.block_manager.stats()
    engine.warm_up()
    after = engine.block_manager.stats()
    assert not engine.has_unfinished() and "__warm_up__" not in engine._seqs
    assert after.num_free_blocks == after.num_blocks and after.num_cached_blocks == before.num_cached_blocks
    assert llm.generate("Hello there", greedy)[0].token_ids == ref
