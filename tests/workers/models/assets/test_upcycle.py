"""Sparse upcycling (workers/models/assets/upcycle.py) on a tiny random dense Llama: with noise 0 the
Mixtral computes exactly the dense model (top-k weights sum to 1 over identical experts), in HF
transformers and in Duet; the build is deterministic (same arguments, same bytes) and reused when
cached; with noise the experts differ and routing is uneven."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from testkit.mixtral_tiny import prefill_logits
from workers.llm import LLM
from workers.models.assets.upcycle import upcycle

from testkit.tolerance import MODEL_FP32

PROMPT = [1, 504, 3575, 282, 4649, 314, 28, 2]


@pytest.fixture(scope="module")
def dense(tmp_path_factory, smollm2_path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, vocab_size=49152, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("dense") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in smollm2_path.iterdir():
        if f.name.startswith("tokenizer"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def test_noise_free_upcycle_equals_dense(dense, tmp_path):
    moe = upcycle(dense, tmp_path / "moe", num_experts=4, top_k=2, noise=0.0)
    ref = _hf_logits(dense)
    MODEL_FP32.assert_close(_hf_logits(moe), ref)
    llm = LLM(str(moe), kv_cache_memory_bytes=4 << 20, block_size=8)
    assert llm.engine.spec.model_type == "mixtral" and llm.engine.spec.num_experts == 4
    MODEL_FP32.assert_close(prefill_logits(llm.engine, [PROMPT]), ref)


def test_deterministic_cached_and_uneven(dense, tmp_path):
    a = upcycle(dense, tmp_path / "a", seed=3)
    b = upcycle(dense, tmp_path / "b", seed=3)
    assert _digest(a) == _digest(b)
    mtime = (a / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    assert upcycle(dense, tmp_path / "a", seed=3) == a  # reused, not rebuilt
    assert (a / "model-00001-of-00003.safetensors").stat().st_mtime_ns == mtime
    assert _digest(upcycle(dense, tmp_path / "c", seed=4)) != _digest(a)

    llm = LLM(str(a), kv_cache_memory_bytes=4 << 20, block_size=8)
    moe = llm.engine.runner.model.moe_layers()[0]
    assert not torch.equal(moe.experts.gate_up_proj[0], moe.experts.gate_up_proj[1])  # experts differ
    prefill_logits(llm.engine, [list(range(100, 300))])
    counts = moe.expert_counts.tolist()
    assert sum(counts) == 400 and max(counts) > 1.3 * (sum(counts) / len(counts))  # uneven routing
