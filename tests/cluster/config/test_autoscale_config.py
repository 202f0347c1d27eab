"""The ``autoscaling`` config section (cluster/config/autoscale.py): a valid section becomes the
decision function's AutoscalerConfig with SLOs in seconds and the profile's capacity; each mistake
is a ClusterConfigError naming the key, its source and the fix."""

from __future__ import annotations

import json

import pytest

from cluster.config.duet import ClusterConfigError, load_config

PROFILE = {"format": "duet-profile/1", "model": "SmolLM2-135M-Instruct", "pool_type": "decode",
           "slo": {"tpot_p90_s": 0.1}, "capacity": {"requests_per_s": 2.0, "mean_output_tokens": 50.0}}


@pytest.fixture
def files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))

    def write(autoscaling: str) -> str:
        path = tmp_path / "duet.yaml"
        path.write_text(f"""
pools:
  - {{name: prefill, role: prefill, replicas: 1}}
  - {{name: decode, role: decode, replicas: 2}}
autoscaling:
{autoscaling.replace('PROFILE', str(tmp_path / 'p.json'))}
""")
        return str(path)
    return write


def test_valid_section_becomes_the_autoscaler_config(files):
    config = load_config(files("""  enabled: true
  interval_s: 5
  down_cooldown_s: 120
  pools:
    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, min_replicas: 1, max_replicas: 6}
    - {pool: prefill, slo_ttft_ms: 500, profile: PROFILE, max_replicas: 3, smoothing_s: 0, headroom: 0.3}"""), env={})
    a = config.to_autoscaler_config()
    decode, prefill = a.pool("decode"), a.pool("prefill")
    assert (decode.role, decode.slo.tpot_p90_s, decode.slo.ttft_p90_s, decode.max_replicas) == ("decode", 0.08, None, 6)
    assert decode.capacity.output_tokens_per_s == 100.0
    assert (prefill.role, prefill.slo.ttft_p90_s, prefill.headroom) == ("prefill", 0.5, 0.3)
    assert (decode.fed_by, prefill.fed_by) == ("prefill", None)  # the one scaled prefill pool feeds decode
    assert a.down_cooldown_s == 120.0 and config.autoscaling.interval_s == 5.0
    assert (a.scale_down, a.short_window_s) == ("drain", 30.0)  # drain unless the actuator migrates
    assert load_config(env={}).autoscaling.enabled is False  # off by default


def test_scale_down_by_migration_reaches_the_autoscaler_config(files):
    config = load_config(files("""  scale_down: migrate
  migration_s: 4
  short_window_s: 20
  pools:
    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE}"""), env={})
    a = config.to_autoscaler_config()
    assert (a.scale_down, a.migration_s, a.short_window_s) == ("migrate", 4.0, 20.0)
    assert a.pool("decode").fed_by is None  # no scaled prefill pool: no burst cap


@pytest.mark.parametrize("section, message", [
    ("  pools:\n    - {pool: nope, slo_tpot_ms: 80, profile: PROFILE}",
     r"autoscaling.pools\[0\].pool='nope' .*: must be one of the configured pools \(prefill, decode\)"),
    ("  pools:\n    - {pool: decode, profile: PROFILE}",
     r"autoscaling.pools\[0\].slo_tpot_ms=None .*decode pool: it scales on time per output token"),
    ("  pools:\n    - {pool: prefill, slo_tpot_ms: 80, profile: PROFILE}",
     r"autoscaling.pools\[0\].slo_ttft_ms=None .*prefill pool: it scales on TTFT"),
    ("  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: /nope.json}",
     r"autoscaling.pools\[0\].profile='/nope.json' .*measure one with `duet profile --out FILE`"),
    ("  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, min_replicas: 3}",
     r"autoscaling.pools\[0\].min_replicas=3 .*starts with 2 replicas"),
    ("  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, min_replicas: -1}",
     r"autoscaling.pools\[0\].min_replicas=-1 .*>= 0"),
    ("  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, max_standby: -2}",
     r"autoscaling.pools\[0\].max_standby=-2 .*must be >= 0"),
    ("  enabled: true", r"autoscaling.pools=\[\] .*lists no pool to scale"),
    ("  interval_s: 0", r"autoscaling.interval_s=0 .*must be > 0 seconds"),
    ("  metrics_urls: [router:9090]", r"autoscaling.metrics_urls\[0\]='router:9090' .*http://router:9090/metrics"),
    ("  pools:\n    - {pool: decode, slo_tpot_ms: -1, profile: PROFILE}", r"slo_tpot_ms=-1 .*> 0"),
    ("  scale_down: kill", r"autoscaling.scale_down='kill' .*must be drain .* or migrate"),
    ("  migration_s: -1", r"autoscaling.migration_s=-1 .*must be >= 0 seconds"),
])
def test_mistakes_name_the_key(files, section, message):
    with pytest.raises(ClusterConfigError, match=message):
        load_config(files(section), env={})


def test_the_merged_config_loads_back(files, tmp_path):
    """What `duet serve --dry-run` prints (to_dict as YAML) is itself a valid config: empty lists
    (no metrics_urls, no pools to scale) included."""
    import yaml

    for config in (load_config(env={}), load_config(files(
            "  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, max_replicas: 4}"), env={})):
        path = tmp_path / "merged.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()))
        assert load_config(path, env={}) == config


def test_no_router_here_needs_metrics_urls_before_anything_starts(files, smollm2_path):
    from cluster.deploy.serve import ServeError, start_deployment

    config = load_config(files("  enabled: true\n  pools:\n    - {pool: decode, slo_tpot_ms: 80, profile: PROFILE, "
                               "max_replicas: 4}"), env={}, overrides={"model.name": str(smollm2_path)})
    with pytest.raises(ServeError, match="autoscaling.metrics_urls"):
        start_deployment(config, with_router=False)  # fails at once: no Ray, no pool was started
