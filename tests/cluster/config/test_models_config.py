"""Several models in one deployment config (``models``, ``pools[].model``, adapters): each pool's
workers get their model's EngineConfig, the router config lists every model with its adapters, the
single ``model`` config is unchanged, and bad combinations are refused in one line naming the key
(the tokenizer check of a drafter pool against every model drafting on it runs in the preflight)."""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.config.duet import ClusterConfigError, load_config
from cluster.deploy.preflight import preflight
from tests.testkit.tiny_families import save_tiny

TWO = {
    "models": [{"name": "SmolLM2-135M-Instruct", "adapters": [{"name": "sql", "source": "/a/sql", "pinned": True}]},
               {"name": "/models/tiny-llama", "served_name": "tiny", "dtype": "float32", "quantization": "int8",
                "max_model_len": 256, "adapter_dir": "/a/tiny"}],
    "pools": [{"name": "smol", "model": "SmolLM2-135M-Instruct"}, {"name": "tiny", "model": "tiny"}],
}


def _load(tmp_path, data, **overrides):
    path = tmp_path / "duet.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, env={}, overrides=overrides or None, flag_names={"model.name": "--model"})


def test_each_pool_runs_the_model_it_names(tmp_path):
    c = _load(tmp_path, TWO)
    assert [m.served for m in c.served_models] == ["SmolLM2-135M-Instruct", "tiny"]
    smol, tiny = (c.to_engine_config(p) for p in c.pools)
    assert (smol.model, smol.quantization) == ("SmolLM2-135M-Instruct", "none")
    assert (tiny.model, tiny.quantization, tiny.dtype, tiny.max_model_len) == ("/models/tiny-llama", "int8",
                                                                                "float32", 256)
    assert [c.model_name_of(p) for p in c.pools] == ["SmolLM2-135M-Instruct", "tiny"]  # what members carry
    r = c.to_router_config({"SmolLM2-135M-Instruct": "/ckpt/smol", "tiny": "/ckpt/tiny"}, {"tiny": 200})
    assert (r.model_name, r.tokenizer_path, [a.name for a in r.adapters]) == ("SmolLM2-135M-Instruct",
                                                                              "/ckpt/smol", ["sql"])
    (other,) = r.models
    assert (other.name, other.tokenizer_path, other.max_model_len, other.adapter_dir) == ("tiny", "/ckpt/tiny",
                                                                                           200, "/a/tiny")
    assert c.to_dict()["models"][1]["served_name"] == "tiny"


def test_the_single_model_config_is_unchanged(tmp_path):
    c = load_config(env={}, overrides={"model.name": "/ckpt/my-model"})
    assert c.models == () and c.served_models == (c.model,) and c.model_of(c.pool) is c.model
    assert c.model_name_of(c.pool) == ""  # members say "the default model"
    assert c.to_router_config("/ckpt/my-model").served_models[0].name == "my-model"
    c = _load(tmp_path, {"model": {"name": "SmolLM2-135M-Instruct", "adapters": [{"name": "sql", "source": "/a"}]},
                         "pools": [{"name": "p", "model": "SmolLM2-135M-Instruct"}]})
    assert [a.name for a in c.to_router_config("/x").adapters] == ["sql"]


def _with(path: str, value):
    data = json.loads(json.dumps(TWO))
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return data


@pytest.mark.parametrize("data, words", [
    (_with("pools.1.model", "nope"), "pools[1].model='nope' (from"),
    (_with("pools.1.model", None), ("pools[1].model=None (from ", "with several models each pool names the one")),
    (_with("models.1.served_name", "SmolLM2-135M-Instruct"), "models[1].name='/models/tiny-llama' (from"),
    (_with("models.1.served_name", "a:b"), "models[1].served_name='a:b'"),
    (_with("models.1.adapters", [{"name": "sql", "source": "/b"}]), "models[1].adapters[0].name='sql'"),
    (_with("models.1.adapters", [{"name": "tiny", "source": "/b"}]), "the name is taken by models[1]"),
    (_with("models.0.adapters", [{"name": "x y", "source": "/b"}]), "models[0].adapters[0].name='x y'"),
    (_with("models.0.adapters", [{"name": "x"}]), "models[0].adapters[0].source"),
    (_with("pools.1.model", "SmolLM2-135M-Instruct"), "models[1].name='/models/tiny-llama' (from"),
    ({**TWO, "pools": [*TWO["pools"], {"name": "d", "role": "drafter", "model": "tiny", "drafter": {"model": "x"}}]},
     "pools[2].model='tiny'"),
])
def test_bad_model_combinations_are_refused_naming_the_key(tmp_path, data, words):
    with pytest.raises(ClusterConfigError) as e:
        _load(tmp_path, data)
    for fragment in (words,) if isinstance(words, str) else words:
        assert fragment in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_model_and_models_together_are_refused(tmp_path):
    with pytest.raises(ClusterConfigError, match=r"model.name='other' \(from flag --model\): set either `model`"):
        _load(tmp_path, TWO, **{"model.name": "other"})


def test_preflight_checks_a_drafter_pool_against_every_model_it_drafts_for(tmp_path, smollm2_path):
    """A drafter pool drafting for a pool of another tokenizer is refused before anything starts,
    naming both the drafter and that model."""
    other = save_tiny(tmp_path / "other", smollm2_path, "llama")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # another tokenizer: ids 100 and 101 swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    drafter = save_tiny(tmp_path / "drafter", smollm2_path, "llama")  # SmolLM2's tokenizer
    spec = {"method": "draft_model", "drafter_pool": "drafters"}
    data = {"models": [{"name": str(smollm2_path), "served_name": "smol"}, {"name": str(other), "served_name": "other"}],
            "pools": [{"name": "smol", "model": "smol", "speculative": spec},
                      {"name": "other", "model": "other"},
                      {"name": "drafters", "role": "drafter", "drafter": {"model": str(drafter)}}]}
    preflight(_load(tmp_path, data))  # the drafter shares the tokenizer of smol, its only leader
    data["pools"][1]["speculative"] = spec  # now it drafts for "other" too
    with pytest.raises(ClusterConfigError) as e:
        preflight(_load(tmp_path, data))
    assert "pools[2].drafter.model=" in str(e.value) and f"models[1].name={str(other)!r} (pool other)" in str(e.value)
