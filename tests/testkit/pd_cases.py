"""Rank functions for the disaggregation x gang tests and the runner contract test (module-level
so spawned ranks import them). Every gang's rank 0 builds its engine over a GangRunner (injected at
construction); the other ranks follow. Exports and imports cross the process boundary as numpy
arrays (the in-process stand-in for the wire, which carries the same model-wide tensors)."""

from __future__ import annotations

import numpy as np
import torch

from workers.build import build_engine
from workers.engine.engine import Engine
from workers.llm import engine_config
from workers.engine.model_runner import ModelRunner
from workers.engine.gang_runner import GangRunner, follow
from workers.parallel.groups import get_group
from workers.engine.runner import KVExport, Runner
from workers.sampling_params import SamplingParams

SMALL = {"kv_cache_memory_bytes": 8 << 20, "block_size": 8, "max_num_batched_tokens": 32}


def build(path: str, rank: int = 0, gang: bool = False) -> tuple[Engine | None, ModelRunner]:
    """(engine, this rank's ModelRunner): a plain engine, or inside a gang the leader's engine over a
    GangRunner (None on followers, which must then call ``follow``)."""
    config = engine_config(path, **SMALL)
    runner = ModelRunner.from_config(config)
    if rank != 0:
        return None, runner
    top: Runner = GangRunner(runner, get_group("gang")) if gang else runner
    return build_engine(config, runner=top), runner


def params_for(i: int, max_tokens: int) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i (the generator state crosses the hand-off)."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)


def colocated(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    rids = [engine.add_request(f"c{i}", p, params_for(i, max_tokens)) for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[r] for r in rids]


def prefill_exports(engine: Engine, prompts: list[list[int]], first_blocks: list[int], max_tokens: int) -> list[dict]:
    """Prefill every prompt (all in flight together) exporting blocks first_blocks[i].."""
    for i, (p, b) in enumerate(zip(prompts, first_blocks)):
        engine.add_request(f"r{i}", p, params_for(i, max_tokens), export_from_block=b)
    exports: dict[str, KVExport] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.finished and o.kv_export is not None
            exports[o.request_id] = o.kv_export
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks, "the prefill side keeps no blocks after export"
    return [{"first_token": e.first_token, "first_block": e.first_block, "kv": e.kv.cpu().numpy(),
             "generator_state": e.generator_state} for e in (exports[f"r{i}"] for i in range(len(prompts)))]


def decode_imports(engine: Engine, prompts: list[list[int]], exports: list[dict], max_tokens: int) -> dict:
    """Reserve, import the exports (sliced to each ticket's first block: the decode side may hold a
    prefix) and decode to the end. -> tokens per prompt and the blocks each ticket waited for."""
    tickets = [engine.reserve(f"r{i}", p, params_for(i, max_tokens)) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    for i, (t, ex) in enumerate(zip(tickets, exports)):
        kv = torch.from_numpy(ex["kv"])[:, :, t.first_block - ex["first_block"]:]
        out = engine.import_kv(f"r{i}", t, kv, ex["first_token"], ex["generator_state"])
        tokens[f"r{i}"] = list(out.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    stats = engine.block_manager.stats()
    assert stats.num_free_blocks == stats.num_blocks and not engine.reserved()
    return {"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "sent": [t.num_blocks for t in tickets]}


def gang_prefill(rank: int, path: str, prompts: list[list[int]], first_blocks: list[int], max_tokens: int):
    """A prefill gang: rank 0 returns the exports (model-wide KV gathered from the ranks)."""
    engine, runner = build(path, rank, gang=True)
    if engine is None:
        follow(runner, get_group("gang"))
        return None
    try:
        return prefill_exports(engine, prompts, first_blocks, max_tokens)
    finally:
        engine.runner.stop()


def gang_decode(rank: int, path: str, prompts: list[list[int]], exports: list[dict], max_tokens: int):
    """A decode gang: rank 0 reserves, imports (each rank receiving its heads) and decodes."""
    engine, runner = build(path, rank, gang=True)
    if engine is None:
        follow(runner, get_group("gang"))
        return None
    try:
        return decode_imports(engine, prompts, exports, max_tokens)
    finally:
        engine.runner.stop()


# ------------------------------------------------------------------------------------ the runner contract
def contract_suite(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """The engine-level suite every Runner must pass (run against a ModelRunner and GangRunners):
    layout and sizes, greedy + seeded generation, a KV round trip through write_blocks/read_blocks,
    generator state round trip, and a hand-off from the engine to itself (export, then import under
    another id) that must reproduce the colocated tokens. Returns what the test compares."""
    runner = engine.runner
    layout = runner.kv_layout()
    spec = runner.spec
    assert layout.holds_all_heads and layout.num_kv_heads == spec.num_kv_heads
    assert runner.num_blocks == engine.block_manager.num_blocks and runner.block_size == layout.block_size
    tokens = colocated(engine, prompts, max_tokens)

    # KV round trip on free blocks: exactly what was written comes back, every head in place
    g = torch.Generator().manual_seed(0)
    ids = [runner.num_blocks - 1, 0, 3]
    kv = torch.randn(layout.num_layers, 2, len(ids), layout.block_size, spec.num_kv_heads, spec.head_dim,
                     generator=g, dtype=torch.float32).to(layout.dtype)
    runner.write_blocks(ids, kv)
    round_trip = bool(torch.equal(runner.read_blocks(ids).cpu(), kv))

    # generator state round trip
    runner.add_request("gen", SamplingParams(temperature=1.0, seed=7), [1, 2, 3], 3)
    state = runner.generator_state("gen")
    runner.set_generator_state("gen", state)
    gen_ok = state is not None and runner.generator_state("gen") == state
    runner.add_request("plain", SamplingParams(temperature=0), [1, 2, 3], 3)
    no_seed = runner.generator_state("plain") is None
    runner.remove_request("gen")
    runner.remove_request("plain")

    # self hand-off: export every prompt from block 0, forget the prefix cache (the round trip
    # overwrote blocks it may point at), import, decode
    engine.block_manager.reset_prefix_cache()
    exports = prefill_exports(engine, prompts, [0] * len(prompts), max_tokens)
    engine.block_manager.reset_prefix_cache()
    handed = decode_imports(engine, prompts, exports, max_tokens)
    moe = runner.moe_stats()
    return {"tokens": tokens, "handoff_tokens": handed["tokens"], "round_trip": round_trip, "gen_ok": gen_ok,
            "no_seed": no_seed, "export_kv": [e["kv"] for e in exports], "moe": (moe.expert_tokens, moe.ep_rank_tokens)}


def contract_rank(rank: int, path: str, prompts: list[list[int]], max_tokens: int):
    engine, runner = build(path, rank, gang=True)
    if engine is None:
        follow(runner, get_group("gang"))
        return None
    try:
        return contract_suite(engine, prompts, max_tokens)
    finally:
        engine.runner.stop()


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray], lengths: list[int]) -> float:
    """Largest difference between two sets of exports [L, 2, n, bs, G, D], relative to each one's
    scale, over the prompt's token slots only (a last block's slots past the prompt hold whatever
    the cache held there before: not part of the hand-off's contract)."""
    def tokens(x: np.ndarray, n: int) -> np.ndarray:
        L, two, nb, bs, g, d = x.shape
        return x.reshape(L, two, nb * bs, g, d)[:, :, :n]
    return max(float(np.abs(tokens(x, n) - tokens(y, n)).max() / max(np.abs(tokens(y, n)).max(), 1e-12))
               for x, y, n in zip(a, b, lengths))
