"""gpu-check's speed section (benchmarks/gpu_check/speed.py), what runs without a GPU: its HF
baselines generate the same greedy tokens with the static cache as with the default cache (so the
fast baseline is a fair one: the same work, not a shortcut), the timing helper measures decode
tokens on a tiny model, and its targets are judged from the table, a missing figure as a miss."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_check import models, speed


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = models.build("qwen2.5-1.5b", tmp_path_factory.mktemp("ckpt"), tiny=True)
    return models.hf_model(path, torch.float32, "cpu")


def test_static_cache_baseline_generates_what_the_default_cache_does(tiny_qwen) -> None:
    prompts = torch.tensor(models.prompts(3, tiny_qwen.config.vocab_size, 12, 13, seed=5))
    eager = speed.hf_generate(tiny_qwen, prompts, 10, "eager")
    assert eager.shape == (3, 10)
    assert torch.equal(speed.hf_generate(tiny_qwen, prompts, 10, "static"), eager)
    assert speed.hf_tok_s(tiny_qwen, 2, tiny_qwen.config.vocab_size, "static", new=6) > 0


def test_the_compiled_arm_asks_for_a_static_cache_and_cuda_graphs() -> None:
    kw = speed.hf_generate_kwargs("static_compile")
    assert kw["cache_implementation"] == "static"
    assert kw["compile_config"].fullgraph and kw["compile_config"].mode == "reduce-overhead"
    assert speed.hf_generate_kwargs("eager") == {"disable_compile": True}
    with pytest.raises(ValueError, match="'paged'"):
        speed.hf_generate_kwargs("paged")


def test_targets_are_judged_and_a_missing_figure_is_a_miss() -> None:
    met = speed.targets({"batch1": {"of_roofline": 0.62}, "batch32": {"vs_hf_static_compile": 2.4}})
    assert all(t["met"] for t in met.values()) and len(met) == 2
    missed = speed.targets({"batch1": {"of_roofline": 0.41}, "batch32": {}})
    assert [t["met"] for t in missed.values()] == [False, False]
    assert missed["batch32_ge_2x_hf_static_compile"]["measured"] is None
