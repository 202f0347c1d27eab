"""benchmarks/autoscale_sim.py takes replica start-ups from a measured profile (cluster/sim/startup.py),
not a constant: a new replica's start-up is the profile's cold (or shared) figure and is the
autoscaler's horizon and the oracle's lead, a promoted standby's is its standby figure; --startup-s
still overrides with a constant; duet-standby reports its standby hours; a missing entry is refused
naming the ones the file has."""

from __future__ import annotations

import json

import pytest

from benchmarks.autoscale_sim import build_parser, run
from cluster.sim.startup import StartupModel, StartupProfileError, load_startup, save_startup


def _args(tmp_path, *extra):
    profile = tmp_path / "startup.json"
    save_startup(profile, "M@cpu", StartupModel(7.5, 3.0, 0.6, "test", prestarted_s=1.4))
    return build_parser().parse_args(["--hours", "0.1", "--policies", "duet,duet-standby", "--startup-profile",
                                      str(profile), "--startup-model", "M@cpu", *extra])


def test_start_ups_come_from_the_measured_profile(tmp_path):
    res = run(_args(tmp_path))
    assert res["startup"]["new_replica_s"] == 7.5 and res["startup"]["standby_s"] == 0.6
    assert res["config"]["startup_s"] == 7.5 and res["startup"]["source"] == "test"
    assert res["runs"]["duet"]["standby_hours"] == 0 and res["runs"]["duet"]["promotions"] == 0
    assert {"standby_hours", "promotions", "standby_peak"} <= set(res["runs"]["duet-standby"])
    assert res["runs"]["duet-standby"]["replica_hours"] >= res["runs"]["duet-standby"]["standby_hours"]


def test_shared_kind_and_a_constant_override(tmp_path):
    assert run(_args(tmp_path, "--startup-kind", "shared", "--policies", "duet"))["startup"]["new_replica_s"] == 3.0
    res = run(_args(tmp_path, "--startup-s", "120", "--policies", "duet"))
    assert res["startup"]["new_replica_s"] == 120.0 and res["startup"]["standby_s"] == 0.6


def test_a_missing_entry_is_refused_naming_the_known_ones(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"A@cpu": {"cold_s": 1, "shared_s": 1, "standby_s": 1}}))
    with pytest.raises(StartupProfileError, match=r"no entry 'B@gpu' \(it has: A@cpu\)"):
        load_startup(path, "B@gpu")
    with pytest.raises(StartupProfileError, match="cold_s=-1"):
        StartupModel(-1, 1, 1)


def test_warm_process_standbys_promote_in_the_profiles_prestarted_time(tmp_path):
    res = run(_args(tmp_path, "--standby-load", "process", "--policies", "duet-standby"))
    assert res["startup"]["standby_s"] == 1.4 and res["startup"]["standby_load"] == "process"
    path = tmp_path / "old.json"  # an entry measured before warm processes existed
    path.write_text(json.dumps({"A@cpu": {"cold_s": 9, "shared_s": 7, "standby_s": 1}}))
    old = load_startup(path, "A@cpu")
    assert old.prestarted_s is None and old.promoted_s("model") == 1
    with pytest.raises(StartupProfileError, match="no prestarted_s"):
        old.promoted_s("process")
    with pytest.raises(StartupProfileError, match="prestarted_s=-2"):
        StartupModel(1, 1, 1, prestarted_s=-2)
