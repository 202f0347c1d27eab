"""Disaggregated prefill/decode at the engine level: a prefill engine computes the prompt and exports
its KV blocks, a decode engine reserves blocks, imports them and decodes. Output must equal the
colocated engine's, token for token (greedy and seeded sampling), on every path: mixed prompt
lengths, many requests in flight, prompts longer than one prefill chunk, and decode-side prefix
hits (which shrink what is sent). Aborting a reservation returns its blocks.

The hand-over here is in-process (the tensor moves directly); tests/workers/kv/test_kv_transfer.py
sends the same exports between two processes over a real gloo pair group."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.engine import Engine, KVCapacityError
from workers.errors import InvalidRequestError
from workers.llm import LLM
from workers.sampling_params import SamplingParams

from testkit.greedy import PROMPTS
from testkit.tolerance import LOGPROB_ACROSS_BATCHES

LONG = ("In the beginning of the project the team wrote down every requirement they could think of, "
        "argued about each one, and then threw most of them away. ") * 6  # ~170 tokens: several chunks


def make_llm(path: Path, **kw) -> LLM:
    kw = {"kv_cache_memory_bytes": 32 << 20, "max_num_batched_tokens": 64, **kw}
    return LLM(str(path), **kw)


def disagg_run(prefill: Engine, decode: Engine, prompts: list[list[int]], params: list[SamplingParams],
               logprobs: dict | None = None):
    """Every request: reserve on decode, prefill + export on prefill (all in flight together), then
    import and decode (all together). -> (token ids per request, blocks sent per request); each
    request's logprobs (as (token, logprob) pairs) go into ``logprobs`` when given."""
    logprobs = {} if logprobs is None else logprobs
    tickets = {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        rid = f"r{i}"
        tickets[rid] = decode.reserve(rid, ids, p)
        prefill.add_request(rid, ids, p, export_from_block=tickets[rid].first_block)
    exports = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert out.finished and out.new_token_ids == [out.kv_export.first_token]
            exports[out.request_id] = out.kv_export
    stats = prefill.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "prefill side keeps no blocks after export"
    tokens: dict[str, list[int]] = {}
    for rid, ex in exports.items():
        assert ex.first_block == tickets[rid].first_block and ex.kv.shape[2] == tickets[rid].num_blocks
        out = decode.import_kv(rid, tickets[rid], ex.kv, ex.first_token, ex.generator_state, ex.first_logprob)
        tokens[rid] = list(out.new_token_ids)
        logprobs[f"c{rid[1:]}"] = [(lp.token_id, lp.logprob) for lp in out.new_logprobs or ()]
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[f"c{out.request_id[1:]}"] += [(lp.token_id, lp.logprob) for lp in out.new_logprobs or ()]
    stats = decode.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return [tokens[f"r{i}"] for i in range(len(prompts))], [tickets[f"r{i}"].num_blocks for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engines(smollm2_path: Path):
    colocated, prefill, decode = make_llm(smollm2_path), make_llm(smollm2_path), make_llm(smollm2_path)
    return colocated, prefill.engine, decode.engine


def colocated_tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                     logprobs: dict | None = None) -> list[list[int]]:
    engine = llm.engine
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", ids, p)
    tokens = {f"c{i}": [] for i in range(len(prompts))}
    logprobs = {} if logprobs is None else logprobs
    logprobs.update({rid: [] for rid in tokens})
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [(lp.token_id, lp.logprob) for lp in out.new_logprobs or ()]
    return [tokens[f"c{i}"] for i in range(len(prompts))]


def test_greedy_equals_colocated_mixed_lengths_concurrent(engines, tokenizer):
    colocated, prefill, decode = engines
    prompts = [tokenizer.encode(p) for p in [*PROMPTS, LONG, LONG + " And then"]]
    assert max(map(len, prompts)) > prefill.config.scheduler.max_num_batched_tokens  # multi-chunk prefill
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 1, 8, 24, 16, 24, 5, 24, 24, 12)]
    want = colocated_tokens(colocated, prompts, params)
    got, _ = disagg_run(prefill, decode, prompts, params)
    assert got == want


def test_seeded_sampling_equals_colocated(engines, tokenizer):
    colocated, prefill, decode = engines
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=s, max_tokens=20) for s in (1, 2, 3, 4)]
    want = colocated_tokens(colocated, prompts, params)
    got, _ = disagg_run(prefill, decode, prompts, params)
    assert got == want


def test_penalties_min_tokens_and_logprobs_equal_colocated(engines, tokenizer):
    """The sampler state travels: the first token is drawn on the prefill side with the request's
    penalties, bias and min_tokens; the decode side continues from the same token counts and
    generator state; logprobs (the first one from the prefill side) are the colocated ones."""
    colocated, prefill, decode = engines
    prompts = [tokenizer.encode(p) for p in [*PROMPTS[:4], LONG]]
    shared = dict(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4,
                  logit_bias={tokenizer.eos_token_id: -5.0, 13: 1.5}, min_tokens=6, top_logprobs=3)
    params = [SamplingParams(temperature=0, **shared), SamplingParams(temperature=0.8, seed=5, min_p=0.05, **shared),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=8, top_logprobs=0),
              SamplingParams(temperature=1.0, seed=9, top_k=40, frequency_penalty=1.5, max_tokens=12),
              SamplingParams(temperature=0, **shared)]
    want_lp, got_lp = {}, {}
    want = colocated_tokens(colocated, prompts, params, want_lp)
    got, _ = disagg_run(prefill, decode, prompts, params, got_lp)
    assert got == want
    assert want_lp.keys() == got_lp.keys()
    for rid in want_lp:
        assert [t for t, _ in got_lp[rid]] == [t for t, _ in want_lp[rid]]
        assert [v for _, v in got_lp[rid]] == LOGPROB_ACROSS_BATCHES.approx([v for _, v in want_lp[rid]])
    assert len(got_lp["c0"]) == len(got[0]) and not got_lp["c3"]  # logprobs only where asked


def test_decode_prefix_hits_send_fewer_blocks(engines, tokenizer):
    colocated, prefill, decode = engines
    decode.block_manager.reset_prefix_cache()
    system = tokenizer.encode(LONG)
    prompts = [system + tokenizer.encode(q) for q in (" Where is Peru?", " Who built the pyramids?")]
    params = [SamplingParams(temperature=0, max_tokens=12)] * 2
    want = colocated_tokens(colocated, prompts, params)
    first, sent_first = disagg_run(prefill, decode, prompts[:1], params[:1])
    second, sent_second = disagg_run(prefill, decode, prompts[1:], params[1:])
    bs = decode.block_manager.block_size
    assert [first[0], second[0]] == want
    assert sent_first[0] == -(-len(prompts[0]) // bs)
    assert sent_second[0] <= -(-len(prompts[1]) // bs) - len(system) // bs  # the shared blocks stayed home


def test_abort_returns_reserved_blocks_and_bad_input_is_typed(engines, tokenizer):
    _, prefill, decode = engines
    free = decode.block_manager.num_free_blocks
    ticket = decode.reserve("gone", tokenizer.encode(LONG), SamplingParams(temperature=0, max_tokens=4))
    assert decode.block_manager.num_free_blocks < free and decode.stats().num_reserved == 1
    assert decode.abort("gone").finish_reason.value == "abort"
    assert decode.block_manager.num_free_blocks == free and decode.stats().num_reserved == 0
    with pytest.raises(InvalidRequestError):
        prefill.add_request("x", [1, 2, 3], SamplingParams(), export_from_block=ticket.num_blocks + 5)
    with pytest.raises(InvalidRequestError):
        decode.reserve("y", [], SamplingParams())
    assert not prefill.has_unfinished() and decode.stats().num_reserved == 0


def test_reserve_without_room_raises_and_keeps_nothing(smollm2_path: Path, tokenizer):
    tiny = LLM(str(smollm2_path), num_blocks=4, block_size=16).engine
    with pytest.raises(InvalidRequestError):  # over the context limit of a 4-block pool
        tiny.reserve("big", tokenizer.encode(LONG), SamplingParams())
    tiny.reserve("a", list(range(1, 40)), SamplingParams())  # 3 blocks
    with pytest.raises(KVCapacityError):
        tiny.reserve("b", list(range(1, 40)), SamplingParams())
    tiny.abort("a")
    assert tiny.block_manager.num_free_blocks == 4 and not tiny.reserved()


def test_speculative_decode_side_equals_colocated(engines, smollm2_path: Path, tokenizer):
    """Spec decoding on the decode worker of a disaggregated pair: prompt lookup, and a drafter whose
    prompt KV is prefetched at reservation (while the target's KV is in transit), so drafting
    starts at the first decode step. Output equals the colocated engine's."""
    from workers.config import CacheConfig, EngineConfig, SpeculativeConfig
    from workers.spec_decode.draft_model import DraftModelProposer
    from workers.spec_decode.drafter import DraftEngine
    from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

    colocated, prefill, _ = engines
    prompts = [tokenizer.encode(p) for p in [*PROMPTS[:4], LONG]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 16, 24, 8, 24)]
    want = colocated_tokens(colocated, prompts, params)
    ngram = make_llm(smollm2_path, speculative=SpeculativeConfig(method="ngram")).engine
    assert disagg_run(prefill, ngram, prompts, params)[0] == want
    assert ngram.stats().spec.num_verifies > 0

    drafter = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                       cache=CacheConfig(kv_cache_memory_bytes=16 << 20)))
    server, endpoint = serve_drafter(drafter)
    try:
        spec = SpeculativeConfig(method="draft_model", draft_model=str(smollm2_path), adaptive=False)
        decode = make_llm(smollm2_path, speculative=spec,
                          proposer=DraftModelProposer(endpoint_connector(endpoint))).engine
        calls = []  # (request, keep, new tokens, drafts wanted) of each item the drafter received
        original = drafter.add
        drafter.add = lambda item: calls.append((item.request_id, item.keep, len(item.new_token_ids),
                                                 item.num_tokens)) or original(item)
        assert disagg_run(prefill, decode, prompts, params)[0] == want
        # the reservations prefetched each whole prompt (num_tokens 0); each request's first drafting
        # round then kept the prompt and sent only the first token
        prefetches = [c for c in calls if c[3] == 0]
        assert sorted(n for _, _, n, _ in prefetches) == sorted(map(len, prompts))
        first = {}
        for rid, keep, new, wanted in calls:
            if wanted > 0:
                first.setdefault(rid, (keep, new))
        assert len(first) == len(prompts) and all(keep > 0 and new == 1 for keep, new in first.values())
        assert decode.stats().spec.num_accepted_tokens > 0
        decode.speculator.close()
    finally:
        server.stop(grace=0)
