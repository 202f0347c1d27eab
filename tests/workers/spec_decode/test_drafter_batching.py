"""The drafter replica's engine (DraftEngine) as a continuous batch: items that join while others
are mid-round draft exactly what they draft alone, whole contexts keep the prefix already held
(nothing recomputed), KV is evicted under pressure and re-prefilled transparently, idle requests
expire, a release mid-round completes the round, and the scheduler batches the rounds of several
streams into shared forward passes."""

from __future__ import annotations

import threading

import pytest

from protos.duet.drafter.v1 import drafter_pb2
from workers.config import CacheConfig, EngineConfig
from workers.sampling_params import SamplingParams
from workers.spec_decode.drafter import DraftEngine, DraftItem
from workers.spec_decode.drafter_link import DrafterLink
from workers.spec_decode.drafter_service import serve_drafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
CONTEXTS = [[504, 3575, 282, 4649, 314, 1345, 28, 282, 4649],  # "The capital of France is ..."-like ids
            [1470, 1077, 42, 216, 42, 216, 42, 216, 42, 216, 1070],
            list(range(1000, 1040)),
            [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]]


def _engine(path, **cache) -> DraftEngine:
    # int8: its linear kernels are row-invariant, so a request's drafts do not depend on its batch
    return DraftEngine(EngineConfig(model=str(path), quantization="int8",
                                    cache=CacheConfig(**{"kv_cache_memory_bytes": 16 << 20, **cache})))


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return _engine(smollm2_path)


def _alone(engine: DraftEngine, k: int) -> list[list[int]]:
    out = []
    for i, ctx in enumerate(CONTEXTS):
        [res] = engine.propose([DraftItem(f"alone{i}", 0, ctx, k, GREEDY)])
        out.append(res.token_ids)
        engine.release(f"alone{i}")
    return out


def test_items_joining_mid_round_draft_what_they_draft_alone(engine):
    want = _alone(engine, 5)
    passes = engine.stats().forward_passes
    results = [engine.add(DraftItem("j0", 0, CONTEXTS[0], 5, GREEDY))]
    engine.step()
    engine.step()  # j0 is two positions in when the others arrive
    results += [engine.add(DraftItem(f"j{i}", 0, ctx, 5, GREEDY)) for i, ctx in enumerate(CONTEXTS[1:], 1)]
    while not all(r.done for r in results):
        engine.step()
    assert [r.token_ids for r in results] == want
    # 4 requests x 5 positions ran in far fewer passes than 20 (they shared them)
    assert engine.stats().forward_passes - passes <= 9
    for i in range(len(CONTEXTS)):
        engine.release(f"j{i}")
    assert engine.num_requests == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_requests_items_apply_in_order(engine):
    """A second item for a request still drafting waits for the first (a stream's rounds are ordered)."""
    [want1] = engine.propose([DraftItem("o", 0, CONTEXTS[1], 3, GREEDY)])
    held = CONTEXTS[1] + want1.token_ids
    [want2] = engine.propose([DraftItem("o", len(held), [], 3, GREEDY, held_len=len(held))])
    engine.release("o")
    first = engine.add(DraftItem("o", 0, CONTEXTS[1], 3, GREEDY))
    second = engine.add(DraftItem("o", len(held), [], 3, GREEDY, held_len=len(held)))
    while not second.done:
        engine.step()
    assert first.token_ids == want1.token_ids and second.token_ids == want2.token_ids
    engine.release("o")


def test_whole_contexts_keep_the_prefix_held(engine):
    """A target that knows nothing of what the drafter holds (a migrated or resumed request) sends
    the whole context: only tokens past the common prefix are computed."""
    ctx = CONTEXTS[2]
    [first] = engine.propose([DraftItem("w", 0, ctx, 4, GREEDY)])
    before = engine.stats().tokens_computed
    accepted = ctx + first.token_ids[:2] + [7]  # two drafts kept, then the target's own token
    [again] = engine.propose([DraftItem("w", 0, accepted, 4, GREEDY, full_context=True)])
    # the held KV covers ctx + 3 drafts (the 4th is never fed): only the target's token is computed, then
    # the 3 drafts fed back to draft the next ones
    assert engine.stats().tokens_computed - before == 1 + 3
    fresh = _engine_like(engine)
    [want] = fresh.propose([DraftItem("w", 0, accepted, 4, GREEDY)])
    assert again.token_ids == want.token_ids
    engine.release("w")


_FRESH: dict[int, DraftEngine] = {}


def _engine_like(engine: DraftEngine) -> DraftEngine:
    """A second engine on the same checkpoint (cached per test module run)."""
    if id(engine) not in _FRESH:
        _FRESH[id(engine)] = _engine(engine.model_path)
    return _FRESH[id(engine)]


def test_stale_diffs_resync(engine):
    [res] = engine.propose([DraftItem("s", 3, [5], 2, GREEDY)])  # nothing held
    assert res.resync
    [ok] = engine.propose([DraftItem("s", 0, CONTEXTS[0], 2, GREEDY)])
    held = len(CONTEXTS[0]) + 2
    [bad] = engine.propose([DraftItem("s", held - 1, [9], 2, GREEDY, held_len=held + 3)])  # the target's view differs
    assert bad.resync and engine.num_requests == 0 and not ok.resync


def test_eviction_under_pressure_re_prefills_transparently(smollm2_path):
    """A pool of 6 blocks x 16 tokens holds two 40-token contexts with their drafts: the third
    evicts the least recently used idle one, whose next item recomputes its whole context (same
    drafts as a fresh engine computing it), evicting the next idle one in turn."""
    small = _engine(smollm2_path, num_blocks=6)
    roomy = _engine_like(small)
    ctxs = [[1000 + 7 * i + j for j in range(40)] for i in range(3)]
    for i, ctx in enumerate(ctxs):
        small.propose([DraftItem(f"e{i}", 0, ctx, 2, GREEDY)])
    assert small.stats().evictions == 1 and small._seqs["e0"].num_computed_tokens == 0  # e0 was the idlest
    [again] = small.propose([DraftItem("e0", 0, ctxs[0] + [5], 3, GREEDY, full_context=True)])
    assert small.stats().evictions == 2 and small._seqs["e1"].num_computed_tokens == 0
    [want] = roomy.propose([DraftItem("e0", 0, ctxs[0] + [5], 3, GREEDY)])
    assert again.token_ids == want.token_ids
    for i in range(3):
        small.release(f"e{i}")
    roomy.release("e0")
    assert small.block_manager.num_free_blocks == 6 and small.num_requests == 0


def test_idle_requests_expire_and_release_mid_round_completes_it(smollm2_path):
    now = [0.0]
    eng = DraftEngine(EngineConfig(model=str(smollm2_path), quantization="int8",
                                   cache=CacheConfig(kv_cache_memory_bytes=16 << 20)), clock=lambda: now[0])
    eng.propose([DraftItem("idle", 0, CONTEXTS[0], 2, GREEDY)])
    now[0] = 30.0
    eng.propose([DraftItem("busy", 0, CONTEXTS[1], 2, GREEDY)])
    now[0] = 70.0
    assert eng.expire(60.0) == 1 and eng.num_requests == 1  # "idle" (last used at 0) went, "busy" stays
    res = eng.add(DraftItem("busy", 0, CONTEXTS[1] + [3], 6, GREEDY, full_context=True))
    eng.step()
    eng.release("busy")  # the target finished it while a round was in progress
    done = eng.step()
    assert res in done and res.done and len(res.token_ids) < 6
    assert eng.num_requests == 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.stats().expired == 1 and eng.stats().releases == 1


def test_one_replica_batches_the_rounds_of_four_streams(engine):
    """Four targets (four streams) send rounds at once: the replica answers each with its own drafts
    (what the engine drafts in-process) and runs them in shared forward passes."""
    want = _alone(engine, 4)
    server, endpoint = serve_drafter(engine)
    links = [DrafterLink(endpoint, target=f"t{i}") for i in range(4)]
    try:
        passes, rows = engine.stats().forward_passes, engine.stats().batched_rows
        barrier = threading.Barrier(4)
        got: dict[int, list[int]] = {}

        def target(i: int) -> None:
            barrier.wait()
            item = drafter_pb2.DraftItem(request_id=f"s{i}", full_context=True, new_token_ids=CONTEXTS[i],
                                         num_tokens=4, sampling=drafter_pb2.Sampling(temperature=0.0))
            resp = links[i].send([item]).result(timeout=60)
            got[i] = list(resp.drafts[0].token_ids)

        threads = [threading.Thread(target=target, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert [got[i] for i in range(4)] == want
        stats = engine.stats()
        assert stats.batched_rows - rows > stats.forward_passes - passes  # more than one request per pass
        assert server.servicer.num_streams == 4
        for i, link in enumerate(links):
            link.release([f"s{i}"])
    finally:
        for link in links:
            link.close()
        server.stop()
    assert engine.num_requests == 0 and server.servicer.num_streams == 0
