"""RoPE scalings against transformers' own initialisers (ROPE_INIT_FUNCTIONS): the per-position
[cos | sin] table equals transformers' inverse frequencies times its attention factor, for yarn
(plain and DeepSeek mscale), longrope (short factors below the original length, long from there
on) and dynamic (default within max_position_embeddings). Unknown types are refused by name."""

from __future__ import annotations

import pytest
import torch

from workers.errors import ConfigError
from workers.layers.rotary import rope_table

from testkit.tolerance import KERNEL_FP32

D, MAX = 16, 512


def _hf(rope: dict, seq_len: int | None = None):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, head_dim=D,
                               max_position_embeddings=MAX, rope_parameters={"rope_theta": 10000.0, **rope})
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=seq_len)


def _table(inv_freq, factor, positions):
    f = torch.outer(positions.float(), inv_freq.float())
    return torch.cat([f.cos() * factor, f.sin() * factor], dim=-1)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.7,
     "mscale_all_dim": 0.7},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_position_independent_types_match_transformers(rope):
    inv_freq, factor = _hf(rope)
    ours = rope_table(D, MAX, 10000.0, rope)
    KERNEL_FP32.assert_close(ours, _table(inv_freq, factor, torch.arange(MAX)))


def test_longrope_short_then_long_factors():
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 128,
            "short_factor": [1.0 + i / 10 for i in range(D // 2)], "long_factor": [2.0 + i for i in range(D // 2)]}
    short, factor = _hf(rope)
    long, _ = _hf(rope, seq_len=129)
    ours = rope_table(D, MAX, 10000.0, rope)
    pos = torch.arange(MAX)
    KERNEL_FP32.assert_close(ours[:128], _table(short, factor, pos[:128]))
    KERNEL_FP32.assert_close(ours[128:], _table(long, factor, pos[128:]))
    assert factor > 1.0  # max_position / original = 4: cos/sin are scaled


def test_unknown_type_and_missing_keys_are_refused():
    with pytest.raises(ConfigError, match="rope_type='su' is not supported; supported: default, linear"):
        rope_table(D, MAX, 10000.0, {"rope_type": "su"})
    with pytest.raises(ConfigError, match="longrope.*needs short_factor, long_factor"):
        rope_table(D, MAX, 10000.0, {"rope_type": "longrope", "original_max_position_embeddings": 64})
