"""The chart with several models and their LoRA adapters (deploy/helm/duet values `models`,
`model.adapters`, `model.adapterDir`, pools[].model), rendered by the real helm and loaded by Duet's
own loader: each pool serves the model it names with that model's engine settings, adapters reach
the config, the pre-pull prepares every model, and bad values fail naming the value."""

from __future__ import annotations

import pytest
from testkit.helm_tools import CHART, RELEASE, by_kind, loaded_config, one, render, run_helm

EXAMPLE = CHART / "ci" / "multi-model-values.yaml"


def test_two_models_and_their_adapters_reach_the_config(helm, tmp_path):
    kinds = by_kind(render(helm, EXAMPLE))
    config = loaded_config(kinds, tmp_path)
    assert [m.served for m in config.served_models] == ["SmolLM2-135M-Instruct", "coder"]
    assert [(p.name, config.model_of(p).served) for p in config.pools] == [
        ("smol", "SmolLM2-135M-Instruct"), ("coder", "coder")]
    smol, coder = config.served_models
    assert [(a.name, a.source, a.pinned) for a in smol.adapters] == [
        ("sql", "/models/adapters/smol-sql", True), ("support", "/models/adapters/smol-support", False)]
    assert coder.adapter_dir == "/models/adapters/coder" and [a.name for a in coder.adapters] == ["rust"]
    engine = config.to_engine_config(config.pools[1])  # the coder pool runs the coder model, quantized
    assert (engine.model, engine.quantization, engine.dtype) == ("/models/Qwen2.5-Coder-0.5B-Instruct", "int8",
                                                                  "float32")
    assert config.to_engine_config(config.pools[0]).model == "SmolLM2-135M-Instruct"
    router = config.to_router_config({"SmolLM2-135M-Instruct": "/a", "coder": "/b"})
    assert [m.name for m in router.served_models] == ["SmolLM2-135M-Instruct", "coder"]
    assert [a.name for a in router.adapters] == ["sql", "support"]


def test_the_single_model_chart_is_unchanged_and_takes_adapters(helm, tmp_path):
    config = loaded_config(by_kind(render(helm)), tmp_path)
    assert config.models == () and config.model.name == "SmolLM2-135M-Instruct" and config.pools[0].model is None
    kinds = by_kind(render(helm, None, "model.adapters[0].name=sql", "model.adapters[0].source=/models/sql",
                           "model.adapterDir=/models/adapters"))
    config = loaded_config(kinds, tmp_path)
    assert [(a.name, a.source) for a in config.model.adapters] == [("sql", "/models/sql")]
    assert config.model.adapter_dir == "/models/adapters"


def test_the_pre_pull_prepares_every_model(helm):
    kinds = by_kind(render(helm, EXAMPLE, "modelCache.enabled=true"))
    head = one(kinds, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    init = next(c for c in head["initContainers"] if c["name"] == "model-cache-pre-pull")
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["DUET_PRE_PULL_MODEL"] == "SmolLM2-135M-Instruct /models/Qwen2.5-Coder-0.5B-Instruct"
    assert "for m in $DUET_PRE_PULL_MODEL" in init["command"][-1]


@pytest.mark.parametrize("sets, words", [
    (("pools[1].model=nope",), "pools[1] (coder).model=nope: unknown model; served: [SmolLM2-135M-Instruct coder]"),
    (("pools[1].model=null",), "pools[1] (coder).model: with several models each pool names the one it serves"),
    (("models[1].servedName=SmolLM2-135M-Instruct",), "two models with one name"),
    (("pools[1].model=SmolLM2-135M-Instruct",), "no colocated or decode pool serves coder"),
    (("models[0].adapters[0].name=a:b",), "models/0/adapters/0/name"),  # the schema's pattern
])
def test_bad_model_values_fail_naming_the_value(helm, sets, words):
    args = ["template", RELEASE, str(CHART), "-f", str(EXAMPLE)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode != 0 and words in r.stderr, r.stderr
