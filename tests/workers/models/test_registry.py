"""The fail-fast model check: unsupported architectures, options and feature combinations are
refused in one line naming the model, the field and what is supported; supported ones pass."""

from __future__ import annotations

import json

import pytest

from workers.models.registry import MODEL_REGISTRY, UnsupportedModelError, check_supported


@pytest.mark.parametrize("config, kw, match", [
    ({"model_type": "bert"}, {}, r"model_type 'bert' is not supported; supported: deepseek_v2, .*qwen3_moe"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "su", "factor": 2.0}}, {},
     r"rope_type='su' is not supported; supported: default, linear, llama3, dynamic, yarn, longrope"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.75}, {}, r"partial_rotary_factor=0.75"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, {}, r"hidden_act='relu' is not supported"),
    ({"model_type": "deepseek_v3"}, {"tp_size": 2}, r"deepseek_v3.*tp_size=2 is not supported"),
    ({"model_type": "gemma2"}, {"sp_size": 2}, r"sp_size=2 is not supported"),
    ({"model_type": "mistral", "sliding_window": 4096}, {"sp_size": 2}, r"sp_size=2"),
    ({"model_type": "qwen3_moe"}, {"quantization": "q4"}, r"quantization='q4' is not supported; supported: none"),
    ({"model_type": "qwen3"}, {"ep_size": 2}, r"ep_size=2 needs a mixture-of-experts model"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, {},
     r"topk_method='noaux_tc' is not supported for deepseek_v2; supported: greedy, group_limited_greedy"),
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, {},
     r"scoring_func='softmax' is not supported for deepseek_v3; supported: sigmoid"),
    ({"model_type": "gemma3_text", "layer_types": ["sliding_attention", "chunked_attention"] * 13}, {},
     r"layer_types \['chunked_attention'\] are not supported; supported: sliding_attention, full_attention"),
])
def test_refusals_name_model_field_and_supported(config, kw, match):
    with pytest.raises(UnsupportedModelError, match=match) as info:
        check_supported(config, **kw)
    assert "\n" not in str(info.value)


def test_directory_and_name_in_message(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UnsupportedModelError, match=r"config.json: model_type 't5' is not supported"):
        check_supported(tmp_path)
    with pytest.raises(Exception, match="cannot read the model config"):
        check_supported(tmp_path / "missing")


@pytest.mark.parametrize("model_type", sorted(MODEL_REGISTRY))
def test_every_registered_default_config_passes(model_type):
    spec = check_supported({"model_type": model_type})
    assert spec.model_type == model_type


def test_spec_fields_of_variants():
    g2 = check_supported({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 16})
    assert g2.sliding_layers == (0, 2) and g2.sliding_window == 16 and g2.norm_offset == 1.0
    assert g2.attn_logit_softcap == 50.0 and g2.final_logit_softcap == 30.0
    ds = check_supported({"model_type": "deepseek_v3"})
    assert ds.num_kv_heads == 1 and ds.head_dim == (ds.kv_lora_rank + ds.qk_rope_head_dim) // 2
    assert ds.dense_mlp_layers == (0, 1, 2) and ds.router_bias and ds.n_group == 8
