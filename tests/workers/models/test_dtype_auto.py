"""dtype 'auto': the checkpoint's dtype where the device supports it, float32 on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from workers.config import EngineConfig
from workers.errors import ConfigError
from workers.models.dtype import checkpoint_dtype, resolve_dtype


def _ckpt(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    return tmp_path


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_reads_the_recorded_dtype(tmp_path, key):
    assert checkpoint_dtype(_ckpt(tmp_path, **{key: "bfloat16"})) == "bfloat16"


def test_unrecorded_or_unreadable_is_none(tmp_path):
    assert checkpoint_dtype(_ckpt(tmp_path)) is None
    assert checkpoint_dtype(tmp_path / "nowhere") is None


@pytest.mark.parametrize("stored, device, bf16_ok, quant, want", [
    ("bfloat16", "cpu", True, "none", "float32"),  # half precision on CPU -> float32
    ("float16", "cpu", True, "none", "float32"),
    ("bfloat16", "cuda", True, "none", "bfloat16"),  # as stored where the GPU runs it
    ("bfloat16", "cuda", False, "none", "float16"),  # no bf16 on this GPU
    ("float16", "cuda:0", True, "none", "float16"),
    ("float32", "cuda", True, "none", "float32"),
    (None, "cuda", True, "none", "float32"),
    ("bfloat16", "cuda", True, "q4", "float32"),  # quantized layers run float32 activations
])
def test_auto(tmp_path, monkeypatch, stored, device, bf16_ok, quant, want):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    path = _ckpt(tmp_path, **({"dtype": stored} if stored else {}))
    assert resolve_dtype("auto", path, device, quant) == want


def test_explicit_dtype_wins(tmp_path):
    assert resolve_dtype("bfloat16", _ckpt(tmp_path, dtype="float32"), "cpu") == "bfloat16"


def test_engine_config_default_is_auto_and_resolves(tmp_path):
    cfg = EngineConfig()
    assert cfg.dtype == "auto"
    assert cfg.with_dtype_for(_ckpt(tmp_path, dtype="bfloat16")).torch_dtype is torch.float32
    with pytest.raises(ConfigError, match="dtype='fp8'.*auto"):
        EngineConfig(dtype="fp8")


def test_llm_on_a_bf16_checkpoint_runs_float32_on_cpu(tiny_checkpoint):
    from transformers import AutoConfig

    from workers.llm import LLM

    path = tiny_checkpoint("qwen3", head_dim=16)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(path).dtype == torch.bfloat16
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.config.dtype == "float32"
    assert llm.engine.runner.kv_cache.dtype is torch.float32
