"""Fail fast: `duet serve` and `--dry-run` check the model before Ray or any actor starts
(cluster/deploy/preflight.py, workers/models/support.py), and say what is wrong in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cluster.cli import main
from cluster.config.duet import ClusterConfigError, load_config
from cluster.deploy.preflight import preflight
from workers.errors import CheckpointError
from workers.models.config import ModelSpec


def _checkpoint(path: Path, config: dict) -> Path:
    """A directory the loader accepts up to config.json: the weights are never read here."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({"unused": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2,
        "vocab_size": 100}
# A Llama whose o_proj input (6 heads x 16 = 96 features) splits 48 + 48 over tp 2: off the 32-feature blocks.
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 128, "num_attention_heads": 6,
               "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 100, "max_position_embeddings": 64}


def test_unsupported_architecture_is_one_line_before_ray_starts(tmp_path, capsys, monkeypatch):
    ckpt = _checkpoint(tmp_path / "gpt2", GPT2)
    assert main(["serve", "--dry-run", "--model", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    from workers.models.registry import MODEL_REGISTRY

    assert err[-1] == (f"duet: error: {ckpt}/config.json: model_type 'gpt2' is not supported; supported: "
                       + ", ".join(sorted(MODEL_REGISTRY)))
    from cluster.deploy import serve

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not be started for a model that cannot be served")

    monkeypatch.setattr(serve, "connect", no_ray)
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        serve.start_deployment(load_config(env={}, overrides={"model.name": str(ckpt)}))


def test_a_config_without_a_needed_field_is_a_checkpoint_error(tmp_path):
    ckpt = _checkpoint(tmp_path / "gpt2", GPT2)
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2' has no 'intermediate_size'"):
        ModelSpec.from_pretrained(ckpt)  # was a raw AttributeError


def test_missing_model_and_drafter(tmp_path):
    with pytest.raises(Exception, match="neither an existing directory nor a known model name"):
        preflight(load_config(env={}, overrides={"model.name": str(tmp_path / "nope")}))
    ckpt = _checkpoint(tmp_path / "gpt2", GPT2)
    config = load_config(env={}, overrides={"pool.speculative.method": "draft_model",
                                            "pool.speculative.draft_model": str(ckpt)})
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        preflight(config)


@pytest.mark.parametrize("overrides, message", [
    ({"pool.tp_size": 4}, r"pools\[0\]\.tp_size=4 \(from flag --tp\): with 3 kv heads < tp_size, tp_size must be a "
                          r"multiple of 3 and divide the 9 query heads"),
    ({"pool.ep_size": 2}, r"pools\[0\]\.ep_size=2 \(from flag --ep\): model_type 'llama' has no experts to shard"),
])
def test_parallel_sizes_the_model_cannot_split(smollm2_path, overrides, message):
    sources: dict[str, str] = {}
    config = load_config(env={}, overrides={"model.name": str(smollm2_path), **overrides},
                         flag_names={"pool.tp_size": "--tp", "pool.ep_size": "--ep"}, sources=sources)
    with pytest.raises(ClusterConfigError, match=message):
        preflight(config, sources)


def test_quantized_tp_split_off_the_blocks_names_both_keys(tmp_path):
    ckpt = _checkpoint(tmp_path / "llama", SMALL_LLAMA)
    config = load_config(env={}, overrides={"model.name": str(ckpt), "model.quantization": "q4", "pool.tp_size": 2})
    with pytest.raises(ClusterConfigError, match=r"model\.quantization='q4' \(from flag model\.quantization\) with "
                                                 r"pools\[0\]\.tp_size=2: the row-parallel layer \[96 x 96\]"):
        preflight(config, {"model.quantization": "flag model.quantization"})
    preflight(load_config(env={}, overrides={"model.name": str(ckpt), "pool.tp_size": 2}))  # unquantized: fine
