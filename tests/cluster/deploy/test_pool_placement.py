"""Per-pool placement resources (cluster/deploy/pools.py): what each rank's placement-group bundle and actor
reserve (``rank_bundle`` / ``rank_actor_options``), the config keys ``gpus_per_rank`` and
``resources_per_rank`` validated at the edge, and, on the session's local Ray (2 CPUs and 2 units
of the custom resource ``duet_test_slot``), a pool asking for a resource the cluster lacks fails
with a message naming it -- at once on an embedded Ray, after the placement timeout on a cluster
that might still grow -- while a pool whose resource exists is placed and its actors hold it.

Terms: a *rank* is one Ray actor in its own bundle; a *replica* is a gang of ep * sp * tp ranks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.config.duet import ClusterConfigError, DuetConfig, PoolSection, load_config
from cluster.deploy.pools import PoolError, create_pool, rank_actor_options, rank_bundle
from workers.server.threads import MALLOC_TUNABLES

SLOT = "duet_test_slot"  # offered by the ray_cluster fixture (tests/conftest.py)


def _as_bundle(options: dict) -> dict[str, float]:
    """The resources actor ``options`` ask for, in bundle form (zero GPUs = no GPU key)."""
    out = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {})}
    return {**out, **options["resources"]}


@pytest.mark.parametrize(("section", "bundle"), [
    (PoolSection(cpus_per_replica=1), {"CPU": 1}),
    (PoolSection(cpus_per_replica=2, resources_per_rank={"duet_pool_default": 1}),
     {"CPU": 2, "duet_pool_default": 1}),
    # an MoE gang of ep 2 x tp 2 GPU ranks: every one of its 4 bundles has this shape
    (PoolSection(name="moe", ep_size=2, tp_size=2, cpus_per_replica=3, gpus_per_rank=1,
                 resources_per_rank={"duet_pool_moe": 1}), {"CPU": 3, "GPU": 1, "duet_pool_moe": 1}),
    (PoolSection(cpus_per_replica=1, gpus_per_rank=0.5), {"CPU": 1, "GPU": 0.5}),
])
def test_rank_bundle_and_the_actor_options_ask_for_the_same(section, bundle):
    assert rank_bundle(section) == bundle
    assert _as_bundle(rank_actor_options(section)) == bundle


def test_actor_options_start_the_rank_with_its_thread_settings(tmp_path: Path):
    """The engine section's omp_wait_policy / niceness / memory_tuning reach each rank's process
    environment at start (workers/server/threads.py: Ray reads RAY_worker_niceness, libgomp
    OMP_WAIT_POLICY, glibc GLIBC_TUNABLES)."""
    path = tmp_path / "duet.yaml"
    path.write_text("pools:\n  - {cpus_per_replica: 1, engine: {omp_wait_policy: active, niceness: 4, "
                    "target_itl_ms: 40, memory_tuning: false}}\n")
    config = load_config(path, env={})
    engine = config.to_engine_config()
    assert (engine.omp_wait_policy, engine.niceness, engine.scheduler.target_itl_ms, engine.memory_tuning) == (
        "active", 4, 40, False)
    options = rank_actor_options(config.pool, engine)
    assert options["runtime_env"] == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE", "RAY_worker_niceness": "4"}}
    default = DuetConfig().to_engine_config()
    assert rank_actor_options(PoolSection(cpus_per_replica=1), default)["runtime_env"] == {
        "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "RAY_worker_niceness": "0", "GLIBC_TUNABLES": MALLOC_TUNABLES}}


def test_config_keys_default_load_and_round_trip(tmp_path: Path):
    assert (PoolSection().gpus_per_rank, dict(PoolSection().resources_per_rank)) == (0, {})
    path = tmp_path / "duet.yaml"
    path.write_text("ray: {address: auto}\n"  # custom resources need a cluster whose nodes offer them
                    "pools:\n  - {name: dec, role: decode, cpus_per_replica: 1, gpus_per_rank: 1, "
                    "resources_per_rank: {duet_pool_dec: 1}}\n")
    pool = load_config(path, env={}).pool
    assert (pool.gpus_per_rank, dict(pool.resources_per_rank)) == (1.0, {"duet_pool_dec": 1})
    assert rank_bundle(pool) == {"CPU": 1, "GPU": 1.0, "duet_pool_dec": 1}
    dumped = DuetConfig(pools=(pool,)).to_dict()["pools"][0]  # what `duet serve --dry-run` prints
    assert (dumped["gpus_per_rank"], dumped["resources_per_rank"]) == (1.0, {"duet_pool_dec": 1})


@pytest.mark.parametrize(("key", "value", "words"), [
    ("resources_per_rank", {"CPU": 1}, ["pools[0].resources_per_rank={'CPU': 1}", "set cpus_per_replica / gpus_per_rank"]),
    ("resources_per_rank", {"GPU": 1}, ["GPU has its own key"]),
    ("resources_per_rank", {"slot": 0}, ["slot: amounts must be numbers > 0"]),
    ("resources_per_rank", {"slot": "one"}, ["slot: amounts must be numbers > 0"]),
    ("resources_per_rank", {"slot": True}, ["slot: amounts must be numbers > 0"]),
    ("resources_per_rank", 3, ["pools[0].resources_per_rank=3", "must be a mapping"]),
    ("gpus_per_rank", -1, ["pools[0].gpus_per_rank=-1.0", "must be >= 0"]),
    ("gpus_per_rank", 1.5, ["gpus_per_rank=1.5", "a whole number of GPUs, or a fraction below 1"]),
    ("gpus_per_rank", "many", ["gpus_per_rank='many'", "must be a number"]),
])
def test_bad_placement_values_name_the_key(key, value, words):
    with pytest.raises(ClusterConfigError) as err:
        load_config(env={}, overrides={f"pool.{key}": value})
    for w in words:
        assert w in str(err.value)


def _absent_gang() -> PoolSection:
    return PoolSection(name="absent", cpus_per_replica=1, tp_size=2, resources_per_rank={"duet_absent": 1})


def _pg_states() -> dict[str, str]:
    from ray.util import placement_group_table

    return {pg_id: t["state"] for pg_id, t in placement_group_table().items()}


def test_missing_resource_fails_at_once_on_an_embedded_ray(ray_cluster):
    before = _pg_states()
    with pytest.raises(PoolError, match=r"pool 'absent' needs 1 replicas x 2 ranks .* x 1 duet_absent = 2 duet_absent, "
                                        r"but the embedded Ray has 0; .*resources_per_rank \(an embedded Ray offers no "
                                        r"custom resources"):
        create_pool(_absent_gang(), None, namespace="test-place", embedded=True)
    assert _pg_states() == before  # nothing reserved


def test_missing_resource_on_a_cluster_fails_after_the_timeout_not_hangs(ray_cluster):
    before = _pg_states()
    start = time.monotonic()
    with pytest.raises(PoolError) as err:
        create_pool(_absent_gang(), None, namespace="test-place", embedded=False, placement_timeout_s=1.0)
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "pool 'absent': could not reserve 1 replicas x 2 ranks = 2 bundles of {CPU: 1, duet_absent: 1} (SPREAD)" in message
    assert "0 duet_absent free of 0" in message and "add nodes that offer these resources" in message
    new = {pg: state for pg, state in _pg_states().items() if pg not in before}
    assert list(new.values()) == ["REMOVED"]  # the pending placement group is not left behind


def _group_slots_free() -> float:
    """Free units of the placement groups' view of duet_test_slot: bundles reserve it from the node,
    the actors in them take it from the bundle."""
    import ray

    return sum(v for k, v in ray.available_resources().items() if k.startswith(f"{SLOT}_group_"))


def _eventually(check, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(("replicas", "tp_size"), [(2, 1), (1, 2)], ids=["plain", "gang"])
def test_pool_with_its_resource_is_placed_and_its_actors_hold_it(ray_cluster, replicas, tp_size):
    """Two bundles of {CPU: 1, duet_test_slot: 1} (2 plain workers, or 1 gang of 2 ranks) fill the
    cluster; each rank's actor holds its bundle's slot, and shutdown gives the slots back."""
    import ray

    from workers.config import EngineConfig

    section = PoolSection(name="slotted", replicas=replicas, cpus_per_replica=1, tp_size=tp_size,
                          resources_per_rank={SLOT: 1})
    pool = create_pool(section, EngineConfig(), namespace="test-place", embedded=True, placement_timeout_s=60)
    try:
        bundles = ray.util.placement_group_table(pool.placement_group)["bundles"]
        assert list(bundles.values()) == [{"CPU": 1.0, SLOT: 1.0}] * 2
        ranks = [a for r in pool.replicas for a in (r.actor, *r.followers)]
        assert len(ranks) == 2
        assert ray.get([r.actor.ready.remote() for r in pool.replicas], timeout=120) == [False] * replicas
        followers = [f for r in pool.replicas for f in r.followers]
        assert len(followers) == tp_size - 1 and all(ray.get([f.pid.remote() for f in followers], timeout=120))
        assert _eventually(lambda: ray.available_resources().get(SLOT, 0) == 0)  # both reserved by the bundles
        assert _eventually(lambda: _group_slots_free() == 0)  # and held by the rank actors
    finally:
        pool.shutdown(grace=0)
    assert _eventually(lambda: ray.available_resources().get(SLOT, 0) == 2)


def _node(node_id: str, **resources: float) -> dict:
    return {"NodeID": node_id * 8, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": resources}


@pytest.mark.parametrize(("strategy", "replicas", "nodes", "words"), [
    # 3 nodes offer the pool's resource, 4 bundles need 4 distinct nodes
    ("STRICT_SPREAD", 4, [_node("a", CPU=2, duet_pool_x=9), _node("b", CPU=2, duet_pool_x=9),
                          _node("c", CPU=2, duet_pool_x=9), _node("d", CPU=8)],
     ["pool 'x': placement_strategy STRICT_SPREAD needs 4 nodes that each offer {CPU: 1, duet_pool_x: 1} "
      "(one per bundle: 4 replicas x 1 ranks), but 3 alive nodes do: aaaaaaaa (10.0.0.1), bbbbbbbb",
      "add 1 such nodes", "use placement_strategy SPREAD"]),
    # a dead node does not count
    ("STRICT_SPREAD", 2, [_node("a", CPU=2, duet_pool_x=9), {**_node("b", CPU=2, duet_pool_x=9), "Alive": False}],
     ["needs 2 nodes", "but 1 alive nodes do: aaaaaaaa"]),
    ("STRICT_PACK", 3, [_node("a", CPU=2, duet_pool_x=9), _node("b", CPU=2, duet_pool_x=9)],
     ["pool 'x': placement_strategy STRICT_PACK needs one node that offers {CPU: 3, duet_pool_x: 3} (all 3 bundles"]),
])
def test_strict_strategies_name_what_the_alive_nodes_lack(strategy, replicas, nodes, words):
    from cluster.deploy.pools import strict_shortfall

    section = PoolSection(name="x", replicas=replicas, cpus_per_replica=1, placement_strategy=strategy,
                          resources_per_rank={"duet_pool_x": 1})
    message = strict_shortfall(section, rank_bundle(section), nodes)
    for w in words:
        assert w in message, message


@pytest.mark.parametrize("strategy", ["STRICT_SPREAD", "STRICT_PACK", "SPREAD", "PACK"])
def test_strict_shortfall_is_none_when_the_nodes_suffice_or_the_strategy_is_soft(strategy):
    from cluster.deploy.pools import strict_shortfall

    section = PoolSection(name="x", replicas=2, cpus_per_replica=1, placement_strategy=strategy)
    nodes = [_node("a", CPU=2), _node("b", CPU=2)] if strategy.startswith("STRICT") else [_node("a", CPU=1)]
    assert strict_shortfall(section, rank_bundle(section), nodes) is None
