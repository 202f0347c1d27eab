"""CUDA-graph decode (workers/engine/cuda_graphs.py) on CPU: capture-size choice, config validation, and
the static-buffer + padding path (graphs stood in by ``EagerReplay``) against the plain path,
token for token. Real CUDA graphs vs eager run in `make gpu-check`."""

from __future__ import annotations

import pytest

from workers.config import CacheConfig, EngineConfig, SchedulerConfig, default_capture_sizes
from workers.engine.cuda_graphs import EagerReplay, pick_capture_size
from workers.errors import ConfigError
from workers.sampling_params import SamplingParams


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(6) == (1, 2, 4, 6)
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)


@pytest.mark.parametrize("batch,size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None), (0, 1)])
def test_pick_capture_size(batch: int, size: int | None) -> None:
    assert pick_capture_size((1, 2, 4, 8), batch) == size


def test_graph_config_validation() -> None:
    sched = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16)
    cfg = EngineConfig(device="cuda", cuda_graphs=True, cuda_graph_batch_sizes=[4, 1, 4], scheduler=sched)
    assert cfg.graph_capture_sizes == (1, 4)
    assert EngineConfig(device="cuda", cuda_graphs=True, scheduler=sched).graph_capture_sizes == (1, 2, 4, 8, 16)
    assert EngineConfig(device="cuda").graph_capture_sizes == ()
    with pytest.raises(ConfigError, match=r"cuda_graph_batch_sizes=\[1, 32\]: 32 is larger than scheduler.max_num_seqs \(16\)"):
        EngineConfig(device="cuda", cuda_graphs=True, cuda_graph_batch_sizes=(1, 32), scheduler=sched)
    with pytest.raises(ConfigError, match=r"cuda_graph_batch_sizes=\[0\]: 0 is not a batch size"):
        EngineConfig(device="cuda", cuda_graphs=True, cuda_graph_batch_sizes=(0,))
    with pytest.raises(ConfigError, match=r"cuda_graph_batch_sizes=\[\]: must list at least one"):
        EngineConfig(device="cuda", cuda_graphs=True, cuda_graph_batch_sizes=())
    with pytest.raises(ConfigError, match="cuda_graphs=true needs device cuda"):
        EngineConfig(device="cpu", cuda_graphs=True)


def _run(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):  # staggered lengths: batches of every size 1..len(prompts) occur
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens + 3 * i, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("fused", ["0", "1"])  # module path and the CPU fused decoder stack
def test_padded_static_decode_equals_plain(smollm2_path, tokenizer, fused: str) -> None:
    """Decode steps through the graph runner's static inputs (batch padded up to 4 or 8, block tables
    max_model_len wide) give the plain path's tokens, and padding rows write no KV block."""
    from workers.build import build_engine

    cfg = EngineConfig(model=str(smollm2_path), max_model_len=256, fused_decode=fused == "1",
                       cache=CacheConfig(num_blocks=96, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "1, 2, 3,",
                                             "Once upon a time", "Les fleurs du jardin sont")]
    plain = build_engine(cfg, tokenizer=tokenizer)
    want = _run(plain, prompts, 6)
    graphs = build_engine(cfg, tokenizer=tokenizer)
    graphs.runner.capture_graphs(graphs.max_model_len, sizes=(1, 4, 8), graph_factory=EagerReplay)
    before = graphs.runner.kv_cache.clone()
    assert graphs.runner.graphs is not None and graphs.runner.graphs.width == 256 // 16
    assert (graphs.runner.kv_cache == before).all(), "capture wrote into the KV cache"
    replays = []
    run = graphs.runner.graphs.run
    graphs.runner.graphs.run = lambda *a: replays.append(a[0].shape[0]) or run(*a)
    assert _run(graphs, prompts, 6) == want
    assert {1, 2, 3, 4, 5} <= set(replays), replays  # padded (2, 3 -> 4; 5 -> 8) and exact sizes replayed
    assert graphs.block_manager.stats().num_free_blocks == graphs.block_manager.stats().num_blocks
