"""Devices through the deployment config (YAML, env, flags): pools[].engine.device, cuda_graphs,
cuda_graph_batch_sizes, pools[].speculative.drafter_device; refusals name the key and its source."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config.duet import load_config
from cluster.config.sources import ClusterConfigError


def _yaml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "duet.yaml"
    p.write_text(text)
    return str(p)


def test_gpu_pool_from_yaml(tmp_path: Path) -> None:
    c = load_config(_yaml(tmp_path, """
pools:
  - name: decode
    gpus_per_rank: 1
    engine: {device: cuda, cuda_graphs: true, cuda_graph_batch_sizes: [1, 8]}
    speculative: {method: draft_model, draft_model: x, drafter_device: cpu}
"""), env={})
    e = c.to_engine_config(c.pools[0])
    assert (e.device, e.dtype, e.cuda_graphs, e.cuda_graph_batch_sizes) == ("cuda", "auto", True, (1, 8))
    assert e.speculative.drafter_device == "cpu"


def test_defaults_are_auto() -> None:
    e = load_config(None, env={}).to_engine_config()
    assert (e.device, e.dtype, e.cuda_graphs) == ("auto", "auto", False)


def test_env_and_flags() -> None:
    env = {"DUET_DEVICE": "cuda", "DUET_GPUS_PER_RANK": "1", "DUET_CUDA_GRAPHS": "true", "DUET_DRAFTER_DEVICE": "cpu"}
    c = load_config(None, env=env)
    e = c.to_engine_config()
    assert (e.device, e.cuda_graphs, e.speculative.drafter_device, c.pool.gpus_per_rank) == ("cuda", True, "cpu", 1.0)
    c = load_config(None, env={}, overrides={"pool.engine.device": "cpu"}, flag_names={"pool.engine.device": "--device"})
    assert c.to_engine_config().device == "cpu"


@pytest.mark.parametrize("text,match", [
    ("pools: [{name: d, engine: {device: cuda}}]",
     r"pools\[0\].engine.device='cuda' \(from .*duet.yaml\): pools\[0\].gpus_per_rank is 0"),
    ("pools: [{name: d, engine: {device: gpu}}]", r"pools\[0\].engine.device='gpu' \(from .*\): must be 'auto', 'cpu'"),
    ("pools: [{name: d, gpus_per_rank: 1, engine: {device: cuda, cuda_graphs: true, max_num_seqs: 8, "
     "cuda_graph_batch_sizes: [1, 16]}}]",
     r"pools\[0\].engine.cuda_graph_batch_sizes=\[1, 16\] \(from .*duet.yaml\): 16 is larger than pools\[0\].engine.max_num_seqs \(8\)"),
    ("pools: [{name: d, engine: {device: cpu, cuda_graphs: true}}]",
     r"pools\[0\].engine.cuda_graphs.*needs device cuda"),
    ("pools: [{name: d, speculative: {method: draft_model, draft_model: x, drafter_device: tpu}}]",
     r"pools\[0\].speculative.drafter_device='tpu'.*must be one of auto, cpu, cuda"),
    ("pools: [{name: d, engine: {device: cpu}, speculative: {method: draft_model, draft_model: x, drafter_device: cuda}}]",
     r"pools\[0\].speculative.drafter_device='cuda'.*gpus_per_rank is 0"),
    ("model: {dtype: half}", r"model.dtype='half' \(from .*\): must be auto or one of"),
])
def test_refusals_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ClusterConfigError, match=match):
        load_config(_yaml(tmp_path, text), env={})
