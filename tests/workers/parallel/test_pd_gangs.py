"""Disaggregated prefill/decode between workers of different parallel shapes, at the engine level
(real gangs of spawned processes over gloo; the hand-off crosses processes as the same model-wide
tensors the wire carries, see workers/kv/transfer.py). Each case prefills on one shape, decodes on
another, and must produce the single-process colocated engine's tokens, greedy and seeded:
  - P tp2 -> D tp1 and P tp1 -> D tp2 with SmolLM2 (3 kv heads: rank 0 holds 2, rank 1 holds 1, so
    the gang gathers and scatters uneven head shards);
  - P ep2 -> D tp1 and P tp1 -> D ep2 with a tiny Mixtral (EP ranks replicate attention: the leader
    reads its own cache, and every rank is written the whole KV).
The gathered export also equals the single process's export to fp32 rounding (TP sums partial
products in another order), and neither side keeps a block afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.pd_cases import build, colocated, decode_imports, gang_decode, gang_prefill, max_rel_diff, prefill_exports
from workers.parallel.groups import ParallelConfig
from workers.parallel.launch import spawn_gang

from testkit.tolerance import SHARDED_FP32

PROMPTS = [[1, 504, 3575, 282, 4649, 314], list(range(100, 150)), [7, 8], list(range(300, 341))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory, smollm2_path) -> Path:
    from testkit.mixtral_tiny import save_tiny_mixtral

    return save_tiny_mixtral(tmp_path_factory.mktemp("pd") / "mixtral", smollm2_path, seed=3)


def _single(path: Path) -> dict:
    """The colocated tokens and the single process's exports (and a decode engine's result on them)."""
    engine, _ = build(str(path))
    want = colocated(engine, PROMPTS, MAX_TOKENS)
    engine.block_manager.reset_prefix_cache()
    exports = prefill_exports(engine, PROMPTS, [0] * len(PROMPTS), MAX_TOKENS)
    return {"engine": engine, "tokens": want, "exports": exports}


def _check_both_directions(path: Path, parallel: ParallelConfig) -> None:
    single = _single(path)
    # P gang -> D single
    exports = spawn_gang(gang_prefill, parallel, args=(str(path), PROMPTS, [0] * len(PROMPTS), MAX_TOKENS))[0]
    assert max_rel_diff([e["kv"] for e in exports], [e["kv"] for e in single["exports"]], list(map(len, PROMPTS))) <= SHARDED_FP32.rmax
    engine = single["engine"]
    engine.block_manager.reset_prefix_cache()
    assert decode_imports(engine, PROMPTS, exports, MAX_TOKENS)["tokens"] == single["tokens"]
    # P single -> D gang
    result = spawn_gang(gang_decode, parallel, args=(str(path), PROMPTS, single["exports"], MAX_TOKENS))[0]
    assert result["tokens"] == single["tokens"]
    assert result["sent"] == [-(-len(p) // 8) for p in PROMPTS]  # a fresh decode side holds nothing


def test_tp2_prefill_and_tp2_decode_with_a_single_process_peer(smollm2_path):
    _check_both_directions(smollm2_path, ParallelConfig(tp_size=2))


def test_ep2_prefill_and_ep2_decode_with_a_single_process_peer(tiny_mixtral):
    _check_both_directions(tiny_mixtral, ParallelConfig(ep_size=2))
