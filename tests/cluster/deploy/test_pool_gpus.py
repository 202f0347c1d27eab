"""GPU placement on a local Ray with two logical GPUs (no CUDA behind them): each rank of a TP=2
pool with gpus_per_rank 1 is given its own GPU id, the engine config it receives asks for CUDA,
and the worker refuses to start, naming the key, because this machine has no CUDA."""

from __future__ import annotations

import pytest

from cluster.config.duet import load_config


@pytest.mark.timeout(300)
def test_tp2_ranks_get_distinct_gpus_and_refuse_without_cuda(ray_cluster, smollm2_path, tmp_path) -> None:
    import ray
    import torch

    from cluster.deploy.pools import create_pool

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal under test needs a CPU-only machine")
    cfg_file = tmp_path / "duet.yaml"
    cfg_file.write_text(f"""
model: {{name: {smollm2_path}}}
pools:
  - name: gpu
    tp_size: 2
    cpus_per_replica: 1
    gpus_per_rank: 1
    engine: {{device: cuda}}
""")
    config = load_config(str(cfg_file), env={})
    section = config.pools[0]
    engine_config = config.to_engine_config(section)
    assert engine_config.device == "cuda"
    pool = create_pool(section, engine_config, "gpu-test")
    try:
        [replica] = pool.replicas
        ranks = ray.get([a.rank_device.remote() for a in (replica.actor, *replica.followers)], timeout=120)
        ids = [tuple(r["gpu_ids"]) for r in ranks]
        assert all(len(i) == 1 for i in ids) and len(set(ids)) == 2, ranks
        assert all(r["device"] == "cuda" for r in ranks)
        with pytest.raises(ray.exceptions.RayTaskError, match="device='cuda': this node has no CUDA device"):
            ray.get(replica.actor.start.remote(), timeout=120)
    finally:
        pool.shutdown(grace=0)
