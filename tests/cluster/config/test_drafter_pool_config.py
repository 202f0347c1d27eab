"""Drafter pools in the cluster config: a ``role: drafter`` pool with its own model, quantization,
threads, device and KV, named by a target pool's speculative.drafter_pool; what cannot work is
refused naming the keys (and, model-dependent, by the preflight: a drafter whose tokenizer cannot
serve the target, naming both models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.config.duet import ClusterConfigError, load_config
from cluster.deploy.cpu_share import resolve_cpus
from cluster.deploy.preflight import preflight

GOOD = """
pools:
  - {name: main, role: colocated, speculative: {method: draft_model, drafter_pool: drafters}}
  - name: drafters
    role: drafter
    replicas: 3
    cpus_per_replica: 2
    engine: {device: cpu, kv_cache_memory_bytes: 256MiB, block_size: 32}
    drafter: {model: SmolLM2-135M-Instruct, quantization: int8, threads: 2, idle_timeout_s: 30}
"""


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "duet.yaml"
    path.write_text(text)
    return path


def test_a_drafter_pool_is_a_pool_with_its_own_model_and_engine(tmp_path):
    c = load_config(_yaml(tmp_path, GOOD), env={})
    main, drafters = c.pools
    assert main.speculative.drafter_pool == "drafters" and main.speculative.draft_model is None
    assert drafters.role == "drafter" and drafters.replicas == 3 and drafters.drafter.threads == 2
    e = c.to_drafter_engine_config(drafters)
    assert (e.model, e.quantization, e.dtype, e.device) == ("SmolLM2-135M-Instruct", "int8", "float32", "cpu")
    assert (e.cache.block_size, e.cache.kv_cache_memory_bytes) == (32, 256 << 20)  # its own block size is fine
    assert c.target_pools == (main,)
    assert c.to_router_config("/tok").disagg_block_size == 16  # the targets' block size, not the drafters'


def test_embedded_cpus_are_shared_with_drafter_pools(tmp_path):
    c = load_config(_yaml(tmp_path, GOOD.replace("cpus_per_replica: 2", "cpus_per_replica: null")), env={})
    resolved, note = resolve_cpus(c, 9)  # 1 for the router, 8 for 1 + 3 ranks
    assert [p.cpus_per_replica for p in resolved.pools] == [2, 2] and "4 ranks" in note


@pytest.mark.parametrize("text, words", [
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: nope}}, "
     "{name: d, role: drafter, drafter: {model: x}}]\n",
     ["pools[0].speculative.drafter_pool='nope'", "must name a pool with role drafter", "drafter pools: d"]),
    ("pools: [{name: m}, {name: d, role: drafter, drafter: {model: x}}]\n",
     ["pools[1].name='d'", "no pool's speculative.drafter_pool names this drafter pool"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d}}, {name: d, role: drafter}]\n",
     ["pools[1].drafter.model=None", "role is 'drafter': name the draft model"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d, draft_model: y}}, "
     "{name: d, role: drafter, drafter: {model: x}}]\n",
     ["pools[0].speculative.draft_model='y'", "unset it with pools[0].speculative.drafter_pool='d'"]),
    ("pools: [{name: m, speculative: {method: ngram, drafter_pool: d}}, {name: d, role: drafter, drafter: {model: x}}]\n",
     ["pools[0].speculative.drafter_pool='d'", "needs pools[0].speculative.method='draft_model', not 'ngram'"]),
    ("pools: [{name: m, drafter: {model: x}}]\n",
     ["pools[0].drafter.model='x'", "only a role: drafter pool runs a drafter", "speculative.draft_model"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d}}, "
     "{name: d, role: drafter, tp_size: 2, drafter: {model: x}}]\n",
     ["pools[1].tp_size=2", "a drafter replica is one rank"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d}}, "
     "{name: d, role: drafter, speculative: {method: ngram}, drafter: {model: x}}]\n",
     ["pools[1].speculative.method='ngram'", "a drafter pool drafts for others"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d}}, "
     "{name: d, role: drafter, drafter: {model: x, quantization: q5}}]\n",
     ["pools[1].drafter.quantization='q5'", "must be one of none, int8, q4"]),
    ("pools: [{name: m, speculative: {method: draft_model, drafter_pool: d}}, "
     "{name: d, role: drafter, drafter: {model: x, idle_timeout_s: 0}}]\n",
     ["pools[1].drafter.idle_timeout_s=0.0", "must be > 0 seconds"]),
    ("pools: [{name: d, role: drafter, drafter: {model: x}}]\n", ["needs a colocated or decode pool"]),
])
def test_refused_naming_the_keys(tmp_path, text, words):
    with pytest.raises(ClusterConfigError) as err:
        load_config(_yaml(tmp_path, text), env={})
    for w in words:
        assert w in str(err.value), str(err.value)


def _foreign_tokenizer(smollm2_path: Path, tmp_path: Path) -> Path:
    """SmolLM2's checkpoint with two tokens of its vocabulary swapped: ids that mean other text."""
    out = tmp_path / "foreign"
    shutil.copytree(smollm2_path, out)
    tj = json.loads((out / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def test_preflight_refuses_a_drafter_whose_tokenizer_cannot_serve_the_target(smollm2_path, tmp_path):
    foreign = _foreign_tokenizer(smollm2_path, tmp_path)
    pool = load_config(_yaml(tmp_path, GOOD.replace("SmolLM2-135M-Instruct", str(foreign))), env={},
                       overrides={"model.name": str(smollm2_path)})
    with pytest.raises(ClusterConfigError) as err:
        preflight(pool)
    msg = str(err.value)
    assert f"pools[1].drafter.model='{foreign}'" in msg and f"model.name='{smollm2_path}'" in msg
    assert "its tokenizer cannot serve the target model" in msg and "id 1000 is" in msg
    private = load_config(env={}, overrides={"model.name": str(smollm2_path), "pool.speculative.method": "draft_model",
                                             "pool.speculative.draft_model": str(foreign)})
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.speculative\.draft_model=.*tokenizer cannot serve"):
        preflight(private)
    same = load_config(_yaml(tmp_path, GOOD.replace("SmolLM2-135M-Instruct", str(smollm2_path))), env={},
                       overrides={"model.name": str(smollm2_path)})
    assert preflight(same).model_path == smollm2_path


PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "decode",
           "slo": {"tpot_p90_s": 0.1}, "capacity": {"requests_per_s": 2.0, "mean_output_tokens": 50.0}}


def _autoscaled(tmp_path: Path, pools: str) -> Path:
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    return _yaml(tmp_path, GOOD.replace("replicas: 3", "replicas: 1") + f"""autoscaling:
  enabled: true
  pools:
{pools.replace('PROFILE', str(tmp_path / 'p.json'))}
""")


def test_a_drafter_pool_autoscales_following_the_pool_drafting_on_it(tmp_path):
    c = load_config(_autoscaled(tmp_path, """    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE, max_replicas: 8}
    - {pool: drafters, ratio: 0.5, min_replicas: 1, max_replicas: 4}"""), env={})
    a = c.to_autoscaler_config()
    d = a.pool("drafters")
    assert (d.role, d.follows, d.ratio, d.min_replicas, d.max_replicas) == ("drafter", "main", 0.5, 1, 4)
    from cluster.autoscale.slo import AutoscalerState, PoolMetrics, PoolStatus, decide

    m = PoolMetrics(bucket_s=10.0, arrivals_rps=[9.0] * 6, mean_prompt_tokens=100, mean_output_tokens=50)
    decisions, _ = decide(a, 0.0, {"main": m}, {"main": PoolStatus("main", 1, 1, 0, 0),
                                                 "drafters": PoolStatus("drafters", 1, 1, 0, 0)}, AutoscalerState())
    lead = decisions["main"].desired
    assert lead > 1 and decisions["drafters"].desired == min(4, -(-lead // 2))  # ceil(0.5 x main's)


def test_a_drafter_pool_scales_on_draft_demand_and_benefit_when_given_rows_per_replica(tmp_path):
    c = load_config(_autoscaled(tmp_path, """    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE, max_replicas: 8}
    - {pool: drafters, ratio: 0.5, rows_per_replica: 12, min_speedup: 1.2, verify_token_cost: 0.3, max_replicas: 4}"""),
                    env={})
    d = c.to_autoscaler_config().pool("drafters")
    assert (d.rows_per_replica, d.min_speedup, d.verify_token_cost, d.min_verifies) == (12.0, 1.2, 0.3, 100)


@pytest.mark.parametrize("pools, words", [
    ("    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE, rows_per_replica: 8}",
     ["autoscaling.pools[0].rows_per_replica=8.0", "for drafter pools only"]),
    ("    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE, min_speedup: 1.5}",
     ["autoscaling.pools[0].min_speedup=1.5", "for drafter pools only"]),
    ("    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE}\n    - {pool: drafters, max_replicas: 4}",
     ["autoscaling.pools[1].profile=None"]),  # a drafter pool without ratio is scaled like a target: needs a profile
    ("    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE}\n"
     "    - {pool: drafters, ratio: 0.5, slo_tpot_ms: 80, profile: PROFILE}", None),
    ("    - {pool: drafters, ratio: 0.5, max_replicas: 4}",
     ["autoscaling.pools[0].pool='drafters'", "drafting on it: main; autoscaled: drafters"]),
    ("    - {pool: main, slo_ttft_ms: 500, slo_tpot_ms: 80, profile: PROFILE, ratio: 2}",
     ["autoscaling.pools[0].ratio=2.0", "ratio is for drafter pools only"]),
])
def test_drafter_autoscaling_mistakes_name_the_key(tmp_path, pools, words):
    if words is None:  # SLOs and a profile on a ratio-following drafter pool are simply unused: accepted
        load_config(_autoscaled(tmp_path, pools), env={})
        return
    with pytest.raises(ClusterConfigError) as err:
        load_config(_autoscaled(tmp_path, pools), env={})
    for w in words:
        assert w in str(err.value), str(err.value)
