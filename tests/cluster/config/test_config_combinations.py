"""Combinations of pool roles, parallel sizes, quantization, speculation and placement that cannot
work are refused by the config (what `duet serve --dry-run` runs), naming both keys. Model-dependent
ones (tp/ep/quantized splits vs the checkpoint) are in test_preflight.py; the chart's own refusals in
tests/deploy/test_chart_pools.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.config.duet import ClusterConfigError, load_config

DISAGG = "pools: [{name: p, role: prefill}, {name: d, role: decode}]\n"


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "duet.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, words", [
    ("pools: [{name: p, role: prefill, speculative: {method: ngram}}, {name: d, role: decode}]\n",
     ["pools[0].speculative.method='ngram'", "with pools[0].role='prefill' (from", "speculate on the decode pool"]),
    ("model: {quantization: q4, dtype: bfloat16}\n",
     ["model.quantization='q4'", "with model.dtype='bfloat16'", "float32"]),
    ("model: {dtype: bfloat16}\npools: [{speculative: {method: draft_model, draft_model: /m/d, draft_quantization: q4}}]\n",
     ["pools[0].speculative.draft_quantization='q4'", "with model.dtype='bfloat16'", "drafter runs with the target's dtype"]),
    ("pools: [{resources_per_rank: {duet_pool_default: 1}}]\n",
     ["pools[0].resources_per_rank={'duet_pool_default': 1}", "with ray.address unset (default)",
      "no custom resources"]),
    ("pools: [{speculative: {method: draft_model, draft_model: /m/d, drafter_resources: {drafter: 1}}}]\n",
     ["pools[0].speculative.drafter_resources={'drafter': 1.0}", "with ray.address unset", "no custom resources"]),
    ("pools: [{name: p, role: prefill, engine: {block_size: 32}}, {name: d, role: decode}]\n",
     ["pools=['p', 'd']", "same engine.block_size", "[16, 32]"]),
    ("pools: [{name: p, role: prefill}]\n", ["pools=['p']", "needs a colocated or decode pool"]),
    ("pools: [{tp_size: 2, gpus_per_rank: 1, engine: {device: cuda, cuda_graphs: true}}]\n",
     ["pools[0].engine.cuda_graphs=True", "with pools[0].tp_size=2", "set cuda_graphs to false"]),
])
def test_refused_with_both_keys(tmp_path, text, words):
    with pytest.raises(ClusterConfigError) as err:
        load_config(_yaml(tmp_path, text), env={})
    for w in words:
        assert w in str(err.value)


def test_dry_run_refuses_with_one_line(tmp_path, capsys):
    path = _yaml(tmp_path, "pools: [{name: p, role: prefill, speculative: {method: ngram}}, {name: d, role: decode}]\n")
    assert main(["serve", "--dry-run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("duet: error: pools[0].speculative.method='ngram'")


def test_the_working_neighbours_are_accepted(tmp_path):
    c = load_config(_yaml(tmp_path, DISAGG.replace("role: decode}", "role: decode, speculative: {method: ngram}}")),
                    env={})
    assert [p.speculative.method for p in c.pools] == ["none", "ngram"]
    c = load_config(_yaml(tmp_path, "model: {dtype: bfloat16}\npools: [{speculative: {method: draft_model, "
                                    "draft_model: /m/d}}]\n"), env={})
    assert c.to_engine_config().speculative.draft_quantization == "none"
    c = load_config(_yaml(tmp_path, "ray: {address: auto}\npools: [{resources_per_rank: {duet_pool_default: 1}, "
                                    "speculative: {method: draft_model, draft_model: /m/d, "
                                    "drafter_resources: {drafter: 1}}}]\n"), env={})
    assert dict(c.pool.resources_per_rank) == {"duet_pool_default": 1}
    # drafter_resources only matter to a drafter actor: prompt lookup ignores them
    load_config(_yaml(tmp_path, "pools: [{speculative: {method: ngram, drafter_resources: {drafter: 1}}}]\n"), env={})
