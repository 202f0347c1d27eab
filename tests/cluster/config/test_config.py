"""cluster.config.duet: YAML < env < flags precedence, validation messages that name the key, the
shipped example file, and the conversions to the engine's and the router's configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config.duet import ClusterConfigError, DuetConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[3] / "cluster" / "duet.example.yaml"


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "duet.yaml"
    path.write_text(text)
    return path


def test_example_file_loads_and_documents_the_defaults():
    assert load_config(EXAMPLE, env={}) == DuetConfig()
    text = EXAMPLE.read_text()
    for key in ("model:", "pools:", "router:", "ray:", "controller:", "kv_cache_memory_bytes", "placement_strategy"):
        assert key in text

    def leaves(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict) and v and k not in ("policy_options", "resources_per_rank", "drafter_resources"):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"
    config = DuetConfig().to_dict()
    config.pop("autoscaling")  # documented in its own commented block
    pool = config.pop("pools")[0]
    undocumented = [k for k in [*leaves(config), *leaves(pool)] if f"{k.rsplit('.', 1)[-1]}:" not in text]
    assert undocumented == []


def test_defaults_without_file_or_env():
    c = load_config(env={})
    assert c.model.name == "SmolLM2-135M-Instruct" and c.router.port == 50051 and c.ray.address is None
    assert c.pool.replicas == 1 and c.pool.cpus_per_replica is None  # resolve_cpus: the machine's share


def test_yaml_then_env_then_flags(tmp_path):
    path = _yaml(tmp_path, """
model: {name: /models/a, max_model_len: 1024}
pools:
  - name: main
    replicas: 3
    engine: {kv_cache_memory_bytes: 256MiB, block_size: 32}
router: {port: 6000, policy: least_loaded, policy_options: {}}
ray: {num_cpus: 4}
""")
    c = load_config(path, env={})
    assert (c.model.name, c.model.max_model_len, c.pool.name, c.pool.replicas) == ("/models/a", 1024, "main", 3)
    assert c.pool.engine.kv_cache_memory_bytes == 256 << 20 and c.pool.engine.block_size == 32
    assert (c.router.port, c.router.policy, c.ray.num_cpus) == (6000, "least_loaded", 4)

    env = {"DUET_PORT": "7000", "DUET_REPLICAS": "2", "DUET_MODEL": "/models/b", "DUET_KV_CACHE_MEMORY": "1GiB"}
    c = load_config(path, env=env)
    assert (c.router.port, c.pool.replicas, c.model.name) == (7000, 2, "/models/b")
    assert c.pool.engine.kv_cache_memory_bytes == 1 << 30 and c.pool.engine.block_size == 32  # untouched

    c = load_config(path, env=env, overrides={"router.port": 8100, "pool.replicas": None, "router.policy": "round_robin"})
    assert (c.router.port, c.pool.replicas, c.router.policy) == (8100, 2, "round_robin")  # None = flag not given
    c = load_config(path, env={**env, "DUET_HTTP_PORT": "0"}, overrides={"router.http_port": 8200})
    assert c.router.http_port == 8200 and c.to_router_config("/ckpt").http_port == 8200  # flag > env > default
    assert load_config(path, env={"DUET_HTTP_PORT": "0"}).to_router_config("/ckpt").http is False
    with pytest.raises(ClusterConfigError, match=r"^router.http_port=6000 .*must differ from router.port=6000"):
        load_config(path, env={"DUET_HTTP_PORT": "6000"})


def test_config_file_from_env_and_ray_address(tmp_path):
    path = _yaml(tmp_path, "router: {port: 6001}\n")
    c = load_config(env={"DUET_CONFIG": str(path), "RAY_ADDRESS": "10.0.0.1:6379"})
    assert c.router.port == 6001 and c.ray.address == "10.0.0.1:6379"


@pytest.mark.parametrize("kwargs, words", [
    (dict(env={"DUET_PORT": "70000"}), ["router.port=70000", "env DUET_PORT", "0..65535"]),
    (dict(env={"DUET_PORT": "fifty"}), ["router.port='fifty'", "env DUET_PORT", "integer"]),
    (dict(env={}, overrides={"pool.replicas": 0}, flag_names={"pool.replicas": "--replicas"}),
     ["pools[0].replicas=0", "flag --replicas", ">= 1"]),
    (dict(env={}, overrides={"pool.engine.kv_cache_memory_bytes": "lots"}),
     ["pools[0].engine.kv_cache_memory_bytes", "64MiB"]),
    (dict(env={}, overrides={"router.policy": "fastest"}), ["router.policy='fastest'", "round_robin"]),
    (dict(env={}, overrides={"router.policy_options": {"nope": 1}}), ["router.policy_options", "valid options"]),
    (dict(env={}, overrides={"model.dtype": "int3"}), ["model.dtype='int3'", "float32"]),
    (dict(env={"DUET_QUANTIZATION": "int4"}), ["model.quantization='int4'", "env DUET_QUANTIZATION", "int8, q4"]),
    (dict(env={}, overrides={"model.quantization": "q4", "model.dtype": "bfloat16"},
          flag_names={"model.quantization": "--quantization"}), ["model.quantization='q4'", "float32"]),
    (dict(env={"RAY_ADDRESS": "auto", "DUET_RAY_NUM_CPUS": "2"}), ["ray.num_cpus=2", "embedded"]),
    (dict(env={}, overrides={"pool.speculative.draft_vocab_size": 100}),
     ["pools[0].speculative.draft_vocab_size=100", ">= 256"]),
    (dict(env={}, overrides={"pool.speculative.drafter_threads": -1}),
     ["pools[0].speculative.drafter_threads=-1", ">= 0"]),
    (dict(env={}, overrides={"controller.placement_timeout_s": 0}),
     ["controller.placement_timeout_s=0", "must be > 0 seconds"]),
])
def test_bad_values_name_the_key_and_source(kwargs, words):
    with pytest.raises(ClusterConfigError) as err:
        load_config(**kwargs)
    for w in words:
        assert w in str(err.value)


def test_yaml_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ClusterConfigError, match=r"router\.prot \(from .*duet.yaml\): unknown key in router; "
                                                 r"known keys: host, port"):
        load_config(_yaml(tmp_path, "router: {prot: 1}\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.engine\.block_size=24 \(from .*duet.yaml\): "
                                                 "must be a power of two"):
        load_config(_yaml(tmp_path, "pools: [{engine: {block_size: 24}}]\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools=.*unique"):
        load_config(_yaml(tmp_path, "pools: [{name: a}, {name: a}]\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools=.*colocated or decode pool"):
        load_config(_yaml(tmp_path, "pools: [{name: a, role: prefill}]\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools=.*same engine.block_size"):
        load_config(_yaml(tmp_path, "pools: [{name: p, role: prefill, engine: {block_size: 32}}, "
                                    "{name: d, role: decode}]\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.role='mixed'.*colocated, prefill, decode"):
        load_config(_yaml(tmp_path, "pools: [{role: mixed}]\n"), env={})


def test_disaggregated_pools_sized_apart_and_pool_alias(tmp_path):
    c = load_config(_yaml(tmp_path, "pools: [{name: p, role: prefill, replicas: 2}, "
                                    "{name: d, role: decode, cpus_per_replica: 2}]\n"),
                    overrides={"pool.replicas": "3", "router.disagg_min_prompt_tokens": "64"}, env={})
    assert [(p.name, p.role, p.replicas, p.cpus_per_replica) for p in c.pools] == [("p", "prefill", 3, None),
                                                                                   ("d", "decode", 1, 2)]
    assert c.pool is c.pools[0]
    rc = c.to_router_config("/tok")
    assert rc.disagg_min_prompt_tokens == 64 and rc.disagg_block_size == 16
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path, "model: [\n"), env={})
    with pytest.raises(ClusterConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml", env={})


def test_quantization_reaches_the_engine_config():
    c = load_config(env={"DUET_QUANTIZATION": "int8"})
    assert c.model.quantization == "int8" and c.to_engine_config().quantization == "int8"
    assert load_config(env={}, overrides={"model.quantization": "q4"}).to_engine_config().quantization == "q4"


def test_to_engine_and_router_configs():
    c = load_config(env={}, overrides={"pool.engine.kv_cache_memory_bytes": "64MiB", "pool.engine.max_num_seqs": 8,
                                       "model.max_model_len": 512, "router.port": 0, "router.policy": "round_robin"})
    e = c.to_engine_config()
    assert e.model == "SmolLM2-135M-Instruct" and e.max_model_len == 512
    assert e.cache.kv_cache_memory_bytes == 64 << 20 and e.scheduler.max_num_seqs == 8
    r = c.to_router_config("/ckpt/SmolLM2-135M-Instruct", 300, load_poll_interval_s=0.1)
    assert (r.tokenizer_path, r.model_name, r.max_model_len, r.port, r.policy) == (
        "/ckpt/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", 300, 0, "round_robin")
    assert r.load_poll_interval_s == 0.1


def test_behaviour_switches_are_config_keys_set_from_env_at_the_edge(tmp_path):
    c = load_config(env={})
    assert (c.pool.engine.fused_decode, c.pool.engine.cpu_kernels, c.pool.comm) == (True, True, "auto")
    path = _yaml(tmp_path, "pools: [{name: p, role: prefill}, {name: d, role: decode}]\n")
    c = load_config(path, env={"DUET_FUSED_DECODE": "0", "DUET_DISABLE_CPU_KERNELS": "1", "DUET_COMM": "gloo"})
    for pool in c.pools:  # every pool, not only the first
        e = c.to_engine_config(pool)
        assert (e.fused_decode, e.cpu_kernels, pool.parallel.comm) == (False, False, "gloo")
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.comm='tcp' \(from env DUET_COMM\): must be one of "
                                                 r"auto, shm, gloo"):
        load_config(env={"DUET_COMM": "tcp"})
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.engine\.fused_decode='yes please' \(from env "
                                                 r"DUET_FUSED_DECODE\): must be true or false"):
        load_config(env={"DUET_FUSED_DECODE": "yes please"})
    with pytest.raises(ClusterConfigError, match=r"DUET_DISABLE_CPU_KERNELS='maybe': must be 1"):
        load_config(env={"DUET_DISABLE_CPU_KERNELS": "maybe"})


def test_lower_layer_checks_name_the_yaml_key(tmp_path):
    """Checks written once in workers.config / router.config, reported with the dotted YAML key."""
    cases = [
        ("pools: [{speculative: {num_speculative_tokens: 17}}]",
         r"pools\[0\]\.speculative\.num_speculative_tokens=17 \(from .*duet.yaml\): must be in 1\.\.16"),
        ("pools: [{speculative: {ngram_min: 5}}]",
         r"pools\[0\]\.speculative\.ngram_min=5 \(from .*\), pools\[0\]\.speculative\.ngram_max=4: need 1 <= ngram_min"),
        ("pools: [{speculative: {method: draft_model}}]",
         r"pools\[0\]\.speculative\.method='draft_model' \(from .*\) needs pools\[0\]\.speculative\.draft_model"),
        ("pools: [{speculative: {drafter_resources: {drafter: 0}}}]",
         r"pools\[0\]\.speculative\.drafter_resources=\{'drafter': 0\.0\} .*amounts > 0"),
        ("pools: [{engine: {max_num_seqs: 600}}]",
         r"pools\[0\]\.engine\.max_num_seqs=600 .*between 1 and max_num_batched_tokens \(512\)"),
        ("pools: [{engine: {kv_cache_memory_bytes: 1000}}]",
         r"pools\[0\]\.engine\.kv_cache_memory_bytes=1000 .*at least 1MiB"),
        ("pools: [{tp_size: 0}]", r"pools\[0\]\.tp_size=0 \(from .*\): must be an integer >= 1"),
        ("model: {name: ' '}", r"model\.name=' ' \(from .*\): must name a model"),
        ("model: {max_model_len: 1}", r"model\.max_model_len=1 \(from .*\): must be >= 2"),
        ("router: {max_queue: -1}", r"router\.max_queue=-1 \(from .*\): must be an integer >= 0"),
        ("router: {policy_options: {nope: 1}}", r"router\.policy_options=\{'nope': 1\} \(from .*\): "),
    ]
    for text, pattern in cases:
        with pytest.raises(ClusterConfigError, match=pattern):
            load_config(_yaml(tmp_path, text + "\n"), env={})


def test_unset_cpus_per_replica_shares_the_machine(tmp_path):
    from cluster.deploy.cpu_share import resolve_cpus
    from cluster.deploy.pools import PoolError, rank_bundle

    c = load_config(env={})
    resolved, note = resolve_cpus(c, 8)
    assert resolved.pool.cpus_per_replica == 7 and "7 (8 CPUs, 1 left to the router, 1 rank)" in note
    assert rank_bundle(resolved.pool) == {"CPU": 7}
    with pytest.raises(PoolError, match="cpus_per_replica is unset"):
        rank_bundle(c.pool)  # never placed unresolved
    assert resolve_cpus(c, 1)[0].pool.cpus_per_replica == 1  # never below 1
    assert resolve_cpus(c, None)[0].pool.cpus_per_replica == 1  # an existing cluster: nodes unknown here
    # explicit values stay; the rest share what is left (here 16 - 1 router - 2x3 explicit - 2 drafter = 7 over 3 ranks)
    path = _yaml(tmp_path, "pools: [{name: p, role: prefill, replicas: 2, cpus_per_replica: 3}, {name: d, role: decode, "
                           "replicas: 3, speculative: {method: draft_model, draft_model: /m/d}}]\n")
    c = load_config(path, env={})
    resolved, note = resolve_cpus(c, 16)
    assert [p.cpus_per_replica for p in resolved.pools] == [3, 2]
    assert "cpus_per_replica of d: 2 (16 CPUs, 1 left to the router, 9 to explicit pools and drafters, 3 ranks)" in note
    assert resolve_cpus(load_config(env={"DUET_CPUS_PER_REPLICA": "2"}), 8)[0].pool.cpus_per_replica == 2


def test_an_autoscaled_pool_gets_room_for_its_max_replicas(tmp_path):
    from cluster.deploy.cpu_share import resolve_cpus

    profile = tmp_path / "profile.json"
    profile.write_text('{"format": "duet-profile/1", "model": "m", "pool_type": "decode", "slo": {"tpot_p90_s": 0.1}, '
                       '"capacity": {"requests_per_s": 2.0, "mean_output_tokens": 50.0}}')
    path = _yaml(tmp_path, f"""
pools: [{{name: d, role: decode, replicas: 1}}]
autoscaling:
  enabled: true
  pools: [{{pool: d, slo_tpot_ms: 100, profile: {profile}, min_replicas: 1, max_replicas: 3}}]
""")
    resolved, note = resolve_cpus(load_config(path, env={}), 8)
    assert resolved.pool.cpus_per_replica == 2 and "3 ranks" in note  # (8 - 1) // 3: room for 3 replicas


def test_kv_tier_keys_reach_the_engine_and_are_checked_at_load(tmp_path):
    ok = load_config(_yaml(tmp_path, "pools:\n  - name: default\n    engine: {host_tier_bytes: 64MiB, "
                                     "disk_tier_bytes: 1GiB, tier_load_timeout_s: 2}\n"), env={})
    cache = ok.to_engine_config().cache
    assert (cache.host_tier_bytes, cache.disk_tier_bytes, cache.tier_load_timeout_s) == (64 << 20, 1 << 30, 2.0)
    assert DuetConfig().to_engine_config().cache.host_tier_bytes == "auto"  # on by default, sized by the worker
    auto = load_config(_yaml(tmp_path, "pools:\n  - name: default\n    engine: {host_tier_bytes: auto, "
                                       "disk_tier_bytes: 1GiB}\n"), env={})
    assert auto.to_engine_config().cache.host_tier_bytes == "auto"
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.engine\.disk_tier_bytes=1073741824 .* with "
                                                 r"pools\[0\]\.engine\.host_tier_bytes=0"):
        load_config(_yaml(tmp_path, "pools:\n  - name: default\n    engine: {disk_tier_bytes: 1GiB, "
                                    "host_tier_bytes: 0}\n"), env={})
    with pytest.raises(ClusterConfigError, match=r"pools\[0\]\.engine\.host_tier_bytes"):
        load_config(_yaml(tmp_path, "pools:\n  - name: default\n    engine: {host_tier_bytes: lots}\n"), env={})
