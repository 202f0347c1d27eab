"""KV tiers on models whose cache is not plain multi-head K/V: a sliding-window model (Mistral,
every layer slides: blocks before the window go back to the pool and can be evicted into the tiers)
and MLA models (DeepSeek V2 / V3: latent KV). Tiny random-weight checkpoints (tests/testkit/
tiny_families.py); greedy tokens with host + disk tiers on equal tiers off on a multi-turn workload
with more history than the device cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from testkit.tiny_families import CASES, save_tiny
from workers.llm import LLM
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
DEVICE = dict(num_blocks=24, block_size=4, max_num_batched_tokens=64)  # 96 tokens < 3 x 72 of history


def multi_turn(llm: LLM) -> list[list[int]]:
    """3 conversations x 3 turns of random tokens (~25 tokens a turn), round robin."""
    g = torch.Generator().manual_seed(0)
    hist = [torch.randint(100, 40000, (12,), generator=g).tolist() for _ in range(3)]
    outs = []
    for _ in range(3):
        for i in range(3):
            hist[i] += torch.randint(100, 40000, (14,), generator=g).tolist()
            out = llm.generate([hist[i]], GREEDY)[0].token_ids
            outs.append(out)
            hist[i] += out
    return outs


@pytest.mark.parametrize("case", ["mistral-sliding", "deepseek_v2-mla", "deepseek_v3-mla-grouped"])
def test_tiers_on_equal_tiers_off(case, smollm2_path: Path, tmp_path: Path):
    arch, overrides = CASES[case]
    path = save_tiny(tmp_path / case, smollm2_path, arch, **overrides)
    want = multi_turn(LLM(str(path), **DEVICE))
    kv_block = LLM(str(path), **DEVICE).engine.runner.read_blocks([0])
    block_bytes = kv_block.numel() * kv_block.element_size()
    on = LLM(str(path), host_tier_bytes=4 * block_bytes, disk_tier_bytes=256 * block_bytes,
             disk_tier_dir=str(tmp_path / "disk"), tier_load_timeout_s=60.0, **DEVICE)
    assert multi_turn(on) == want
    t = on.engine.stats().tiers
    assert t.host_hits > 0 and t.disk_hits > 0 and t.refused_corrupt == t.refused_foreign == 0
    on.engine.close()
    assert list((tmp_path / "disk").iterdir()) == []
