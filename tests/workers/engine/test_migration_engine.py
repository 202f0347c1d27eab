"""Live migration at the engine level (workers/engine/migration.py): requests paused mid-generation on one
engine, their KV and state moved to another, decoding on there. Tokens must equal an unmigrated
run's, token for token: greedy, seeded sampling, penalties + min_tokens + stop strings, several
requests in flight, target prefix-cache hits (fewer blocks sent), n-gram and draft-model
speculation, JSON-schema structured output (the target's matcher replays the tokens). Nothing leaks on either side; bad snapshots and a full target are refused, typed.

The hand-over is in-process (the tensor moves directly); tests/workers/handoff/test_migration_service.py
sends it between two worker servers over the real transfer path."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from workers.engine.engine import Engine, KVCapacityError
from workers.errors import InvalidRequestError
from workers.llm import LLM
from workers.engine.migration import MigrationError
from workers.sampling_params import SamplingParams
from workers.engine.sequence import FinishReason, Sequence
from workers.structured.spec import StructuredOutput

from testkit.greedy import PROMPTS

LONG = ("In the beginning of the project the team wrote down every requirement they could think of, "
        "argued about each one, and then threw most of them away. ") * 3


def make_llm(path: Path, **kw) -> LLM:
    kw = {"kv_cache_memory_bytes": 24 << 20, "max_num_batched_tokens": 96, **kw}
    return LLM(str(path), **kw)


def assert_clean(*engines: Engine) -> None:
    for e in engines:
        if e.tiers is not None and not e.scheduler.has_unfinished():
            e.step()  # stores what the last allocations evicted in the host tier (KVTiers.flush): then idle
        s = e.block_manager.stats()
        assert s.num_free_blocks == s.num_blocks, "KV blocks leaked"
        assert not e.has_unfinished() and not e.reserved() and e.migration.num_paused() == 0


def migrate(src: Engine, dst: Engine, rid: str) -> int:
    """Move one decoding request from src to dst (what the worker RPCs do). -> blocks sent."""
    snap = src.pause_request(rid)
    ticket = dst.reserve_migration(snap)
    kv = src.migration_kv(rid, ticket.first_block)
    dst.import_migration(rid, ticket, kv, snap)
    final = src.finish_migrated(rid)
    assert final.finished and final.finish_reason is FinishReason.MIGRATED and not final.new_token_ids
    return ticket.num_blocks


def reference(engine: Engine, prompts, params) -> list[list[int]]:
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"ref{i}", ids, p)
    tokens = {f"ref{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert_clean(engine)
    return [tokens[f"ref{i}"] for i in range(len(prompts))]


def migrated_run(src: Engine, dst: Engine, prompts, params, after: list[int]) -> tuple[list[list[int]], list[int]]:
    """All requests start on src; request i moves to dst once it has ``after[i]`` tokens (and is
    decoding). -> (tokens per request, blocks sent per request)."""
    rids = [f"m{i}" for i in range(len(prompts))]
    for rid, ids, p in zip(rids, prompts, params):
        src.add_request(rid, ids, p)
    tokens = {rid: [] for rid in rids}
    sent: dict[str, int] = {}
    done: set[str] = set()
    while src.has_unfinished() or dst.has_unfinished():
        for engine in (src, dst):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done.add(out.request_id)
        for i, rid in enumerate(rids):
            if rid not in sent and rid not in done and len(tokens[rid]) >= after[i]:
                sent[rid] = migrate(src, dst, rid)
    assert_clean(src, dst)
    return [tokens[r] for r in rids], [sent.get(r, 0) for r in rids]


@pytest.fixture(scope="module")
def pair(smollm2_path: Path):
    return make_llm(smollm2_path).engine, make_llm(smollm2_path).engine


def test_greedy_mixed_lengths_concurrent(pair, tokenizer):
    src, dst = pair
    prompts = [tokenizer.encode(p) for p in [*PROMPTS[:3], LONG]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 12, 10)]
    want = reference(src, prompts, params)
    got, sent = migrated_run(src, dst, prompts, params, after=[1, 5, 9, 3])
    assert got == want
    assert all(n >= 1 for n in sent)


def test_seeded_sampling_and_penalties_continue_exactly(pair, tokenizer):
    """The generator state, penalty counts (from the token ids), min_tokens progress, stop strings
    (the detokenizer's window) and a resumed request's penalty window all carry over."""
    src, dst = pair
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    pen = dict(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4, min_tokens=8,
               logit_bias={tokenizer.eos_token_id: -2.0, 13: 1.5})
    params = [SamplingParams(temperature=0.8, seed=5, min_p=0.05, top_p=0.95, max_tokens=10, **pen),
              SamplingParams(temperature=0, max_tokens=9, **pen),
              SamplingParams(temperature=1.0, seed=9, max_tokens=12, stop=(" the", "."), top_k=40)]
    want = reference(src, prompts, params)
    got, _ = migrated_run(src, dst, prompts, params, after=[6, 2, 3])
    assert got == want


def test_resumed_request_migrates_with_its_penalty_window(pair, tokenizer):
    """A request resumed earlier (its last prompt tokens count as generated for the penalties)
    keeps that window on the target."""
    src, dst = pair
    ids = tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=6, presence_penalty=1.2, frequency_penalty=0.5)
    src.add_request("a", ids, params, resumed_output_tokens=4)  # 4 prompt tokens came from an earlier run
    want = []
    while src.has_unfinished():
        want += [t for o in src.step() for t in o.new_token_ids]
    src.add_request("a", ids, params, resumed_output_tokens=4)
    got = []
    while len(got) < 3:
        got += [t for o in src.step() for t in o.new_token_ids]
    assert migrate(src, dst, "a") >= 1 and dst.migration.reserved() == []
    while dst.has_unfinished():
        got += [t for o in dst.step() for t in o.new_token_ids]
    assert got == want
    assert_clean(src, dst)


def test_target_prefix_hits_send_fewer_blocks(pair, tokenizer):
    src, dst = pair
    ids = tokenizer.encode(LONG)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = reference(dst, [ids], [params])  # dst now caches the prompt's full blocks (the engines are identical)
    got, sent = migrated_run(src, dst, [ids], [params], after=[4])
    bs = dst.block_manager.block_size
    assert got == want
    assert sent[0] <= -(-(len(ids) + 4) // bs) - len(ids) // bs + 1


def test_refusals_are_typed_and_leave_the_request_running(pair, tokenizer):
    src, dst = pair
    ids = tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = reference(src, [ids], [params])[0]
    with pytest.raises(MigrationError, match="not running"):
        src.pause_request("nobody")
    src.add_request("r", ids, params)
    with pytest.raises(MigrationError, match="not decoding"):  # still waiting: nothing computed yet
        src.pause_request("r")
    got = [t for o in src.step() for t in o.new_token_ids]
    snap = src.pause_request("r")
    with pytest.raises(MigrationError, match="already"):
        src.pause_request("r")
    assert src.step() == []  # paused: no step touches it
    with pytest.raises(InvalidRequestError, match="num_computed_tokens"):
        dst.reserve_migration(replace(snap, num_computed_tokens=snap.num_computed_tokens - 1))
    with pytest.raises(InvalidRequestError, match="output_token_ids"):
        dst.reserve_migration(replace(snap, output_token_ids=[10 ** 6] * len(snap.output_token_ids)))
    bm = dst.block_manager  # a target whose pool is taken but for one block
    hog = Sequence("hog", [1], SamplingParams(), 0)
    assert bm.allocate(hog, (bm.num_free_blocks - 1) * bm.block_size)
    with pytest.raises(KVCapacityError):  # two blocks needed
        dst.reserve_migration(replace(snap, request_id="r2", prompt_token_ids=list(range(100, 130)),
                                      num_computed_tokens=30 + len(snap.output_token_ids) - 1))
    assert not dst.reserved() and "r2" not in dst._seqs and bm.num_free_blocks == 1
    bm.free("hog")
    assert_clean(dst)
    assert src.resume_request("r")  # the migration failed: it decodes on here
    while src.has_unfinished():
        got += [t for o in src.step() for t in o.new_token_ids]
    assert got == want
    assert_clean(src)


def test_abort_while_paused_or_reserved_frees_everything(pair, tokenizer):
    src, dst = pair
    src.add_request("p", tokenizer.encode(LONG), SamplingParams(temperature=0, max_tokens=4))
    while not src._seqs["p"].in_decode:
        src.step()
    snap = src.pause_request("p")
    dst.reserve_migration(snap)
    assert dst.stats().num_reserved == 1 and dst.block_manager.num_free_blocks < dst.block_manager.num_blocks
    assert dst.abort("p").finish_reason is FinishReason.ABORT
    assert src.abort("p").finish_reason is FinishReason.ABORT
    assert not src.resume_request("p")
    assert_clean(src, dst)


def test_kv_moves_model_wide_between_runners(pair, tokenizer):
    """What travels is every kv head of the blocks holding the computed tokens."""
    src, _ = pair
    src.add_request("k", tokenizer.encode(LONG), SamplingParams(temperature=0, max_tokens=4))
    while not src._seqs["k"].in_decode:
        src.step()
    snap = src.pause_request("k")
    kv = src.migration_kv("k", 0)
    layout = src.kv_layout()
    assert kv.shape == (layout.num_layers, 2, src.block_manager.blocks_needed(snap.num_computed_tokens),
                        layout.block_size, layout.num_kv_heads, layout.head_dim)
    assert torch.count_nonzero(kv) > 0
    src.abort("k")
    assert_clean(src)


def test_speculative_requests_migrate_identically(pair, smollm2_path: Path, tokenizer):
    """n-gram drafting rebuilds from the token ids; a draft-model drafter re-prefills its own cache
    on the target (its KV does not travel); the draft-length state travels, so seeded requests
    draw the same tokens."""
    from workers.config import CacheConfig, EngineConfig, SpeculativeConfig
    from workers.spec_decode.draft_model import DraftModelProposer
    from workers.spec_decode.drafter import DraftEngine
    from workers.spec_decode.drafter_service import endpoint_connector, serve_drafter

    src, _ = pair
    prompts = [tokenizer.encode(p) for p in
               ["Repeat exactly: red green blue red green blue red green blue red green", PROMPTS[1], PROMPTS[0]]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2, ignore_eos=True)]
    want = reference(src, prompts, params)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    a, b = make_llm(smollm2_path, speculative=ngram).engine, make_llm(smollm2_path, speculative=ngram).engine
    want_spec = reference(a, prompts, params)  # the unmigrated speculative run
    assert [want_spec[0], want_spec[2]] == [want[0], want[2]]  # greedy: speculation changes nothing
    got, _ = migrated_run(a, b, prompts, params, after=[5, 3, 3])
    assert got == want_spec
    assert a.stats().spec.num_verifies + b.stats().spec.num_verifies > 0  # speculation was on

    # each worker has its own drafter (as in a deployment: one drafter actor per worker)
    servers = [serve_drafter(DraftEngine(EngineConfig(model=str(smollm2_path),
                                                      cache=CacheConfig(kv_cache_memory_bytes=8 << 20))))
               for _ in range(2)]
    try:
        spec = SpeculativeConfig(method="draft_model", draft_model=str(smollm2_path), num_speculative_tokens=3,
                                 adaptive=False)
        c, d = (make_llm(smollm2_path, speculative=spec,
                         proposer=DraftModelProposer(endpoint_connector(endpoint), timeout_s=30.0)).engine
                for _, endpoint in servers)
        got, _ = migrated_run(c, d, [prompts[0], prompts[2]], [params[0], params[2]], after=[5, 2])
        assert got == want[:1] + want[2:]
        assert d.stats().spec.num_verifies > 0
        for e in (c, d):
            e.speculator.close()
    finally:
        for server, _ in servers:
            server.stop(grace=0)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                    "minItems": 1, "maxItems": 3}}}


def test_structured_requests_migrate_identically(pair, tokenizer):
    """A JSON-schema-constrained request moves mid-value: the target compiles the spec while the KV
    is in transit and its matcher replays the generated tokens, so the output equals the
    unmigrated run's and validates; a failed migration resumes on the source with its matcher."""
    src, dst = pair
    ids = tokenizer.encode("Describe a person as JSON with a name, an age and favourite colors:")
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    params = [SamplingParams(temperature=0, max_tokens=60, structured=spec),
              SamplingParams(temperature=0.9, seed=3, max_tokens=60, structured=spec)]
    want = reference(src, [ids, ids], params)
    for tokens in want:  # both complete (EOS where the grammar accepts), so the check is meaningful
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), PERSON)
    got, sent = migrated_run(src, dst, [ids, ids], params, after=[4, 7])
    assert got == want and all(n >= 1 for n in sent)
    assert not src._matchers and not dst._matchers and len(src.grammars) == len(dst.grammars) == 0

    # refused while its grammar compiles (a fresh spec: not cached); after a failed migration the
    # request decodes on at the source with the matcher it had
    other = StructuredOutput("json_schema", json.dumps({**PERSON, "required": ["colors", "name", "age"]}))
    src.add_request("s", ids, replace(params[0], structured=other))
    with pytest.raises(MigrationError, match="grammar to compile"):
        src.pause_request("s")
    out = []
    while len(out) < 5:
        out += [t for o in src.step() for t in o.new_token_ids]
    snap = src.pause_request("s")
    ticket = dst.reserve_migration(snap)
    assert dst.abort("s").finish_reason is FinishReason.ABORT  # the transfer failed
    assert src.resume_request("s")
    while src.has_unfinished():
        out += [t for o in src.step() for t in o.new_token_ids]
    jsonschema.validate(json.loads(tokenizer.decode(out, skip_special_tokens=True)), PERSON)
    assert ticket.num_blocks >= 1
    assert_clean(src, dst)
