"""A quantized model whose layers keep a bf16 copy for prompt chunks (quantized_batches: bf16): a
request's decode rows give the same numbers whether its step carries a long prompt chunk or not
(workers/layers/quant_linear.py StepRows), so its greedy tokens and logprobs do not depend on what
else the worker serves meanwhile."""

from __future__ import annotations

from workers.llm import LLM
from workers.sampling_params import SamplingParams

PROMPT = list(range(1000, 1040))
LONG = list(range(3000, 3200))  # a 200-row prompt chunk: past BF16_COPY_MIN_ROWS, on the bf16 copy
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, top_logprobs=2)


def _run(llm: LLM, with_long_prompt_at: int | None) -> list:
    engine = llm.engine
    rid = engine.add_request(None, PROMPT, PARAMS)
    logprobs, steps = [], 0
    while engine.has_unfinished():
        if steps == with_long_prompt_at:
            engine.add_request(None, LONG, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        for out in engine.step():
            if out.request_id == rid:
                logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs or []]
        steps += 1
    return logprobs


def test_decode_rows_do_not_change_when_a_prompt_chunk_shares_the_step(smollm2_path) -> None:
    llm = LLM(str(smollm2_path), quantization="q4", quantized_batches="bf16", kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=512, enable_prefix_caching=False)
    alone = _run(llm, None)
    assert len(alone) == 12
    for at in (2, 5):  # the long prompt's prefill shares a step with this request's decode
        assert _run(llm, at) == alone  # tokens and logprobs, bit for bit
