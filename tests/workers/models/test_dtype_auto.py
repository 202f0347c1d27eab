"""dtype 'auto' on a real checkpoint: the recorded dtype is read, and a half-precision checkpoint runs
float32 on a CPU without AVX512-BF16 / AMX, bfloat16 on one with them (the resolution rules
themselves: tests/workers/engine/test_device.py)."""

from __future__ import annotations

import json

import pytest
import torch

from workers.config import EngineConfig
from workers.errors import ConfigError
from workers.engine.device import checkpoint_dtype


def _ckpt(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    return tmp_path


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_reads_the_recorded_dtype(tmp_path, key):
    assert checkpoint_dtype(_ckpt(tmp_path, **{key: "bfloat16"})) == "bfloat16"


def test_unrecorded_or_unreadable_is_none(tmp_path):
    assert checkpoint_dtype(_ckpt(tmp_path)) is None
    assert checkpoint_dtype(tmp_path / "nowhere") is None


def test_engine_config_default_is_auto(tmp_path):
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype='fp8'.*auto"):
        EngineConfig(dtype="fp8")


def test_llm_on_a_bf16_checkpoint_runs_float32_on_a_cpu_without_native_bf16(tiny_checkpoint):
    # the suite runs with DUET_CPU_BF16=0 (tests/conftest.py): a CPU without AVX512-BF16 or AMX
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


def test_llm_runs_bfloat16_on_a_cpu_with_native_bf16(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch):
    # DUET_CPU_BF16=1 states the CPU fact (kernels/cpu_features.py); the bf16 kernels run on any x86-64 CPU
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    monkeypatch.setenv("DUET_CPU_BF16", "1")
    llm = LLM(str(tiny_checkpoint("qwen3", head_dim=16)), kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.config.dtype == "bfloat16"
    assert llm.engine.runner.kv_cache.dtype is torch.bfloat16
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
