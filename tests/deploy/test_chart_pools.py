"""The chart's pools (deploy/helm/duet): every pool value reaches the Duet config key it stands for
(loaded by cluster.config.duet.load_config), a replica's gang (epSize * spSize * tpSize ranks) sizes its
worker pod, the drafters group and the pools' drafter_resources meet in Ray's scheduler, and bad
values are refused with a message naming the value.

Terms: a *rank* is one Ray actor in its own placement-group bundle (cluster/deploy/pools.py rank_bundle:
cpus_per_replica CPUs, gpus_per_rank GPUs, resources_per_rank); a *replica* (one endpoint) is a gang
of ep_size * sp_size * tp_size ranks; the chart gives each replica one worker pod holding its whole
gang, and each pool's group a custom Ray resource duet_pool_<name> that only the pool's ranks ask for.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from testkit.helm_tools import CHART, RELEASE, by_kind, loaded_config, one, ray_node_types, render, run_helm

from cluster.deploy.pools import rank_bundle

# poolDefaults value (dotted) -> (a --set of it, relative to poolDefaults, other than the default;
# the PoolSection attribute it sets; what that attribute then holds). Every poolDefaults leaf is
# here, in POD_ONLY or in NOT_YET_USED: a new value cannot be added without saying where it goes.
REACHES_CONFIG: dict[str, tuple[str, str, Any]] = {
    "model": ("model=SmolLM2-135M-Instruct", "model", "SmolLM2-135M-Instruct"),  # several: tests/deploy/test_chart_models.py
    "replicas": ("replicas=3", "replicas", 3),
    "standbyReplicas": ("standbyReplicas=2", "standby_replicas", 2),  # also sizes the group (+2 pods)
    "standbyLoad": ("standbyLoad=process", "standby_load", "process"),
    "cpusPerRank": ("cpusPerRank=5", "cpus_per_replica", 5),
    "epSize": ("epSize=2", "ep_size", 2),
    "spSize": ("spSize=2", "sp_size", 2),
    "tpSize": ("tpSize=2", "tp_size", 2),
    "placementStrategy": ("placementStrategy=PACK", "placement_strategy", "PACK"),
    "maxRestarts": ("maxRestarts=3", "max_restarts", 3),
    "gpusPerRank": ("gpusPerRank=2", "gpus_per_rank", 2.0),  # also sizes the pod
    "engine.blockSize": ("engine.blockSize=32", "engine.block_size", 32),
    "engine.kvCacheMemory": ("engine.kvCacheMemory=64MiB", "engine.kv_cache_memory_bytes", 64 << 20),
    "engine.maxNumBatchedTokens": ("engine.maxNumBatchedTokens=1024", "engine.max_num_batched_tokens", 1024),
    "engine.maxNumSeqs": ("engine.maxNumSeqs=8", "engine.max_num_seqs", 8),
    "engine.enablePrefixCaching": ("engine.enablePrefixCaching=false", "engine.enable_prefix_caching", False),
    "engine.device": ("engine.device=cpu", "engine.device", "cpu"),
    "engine.cudaGraphs": ("engine.cudaGraphs=true", "engine.cuda_graphs", True),
    "engine.hostTierMemory": ("engine.hostTierMemory=2GiB", "engine.host_tier_bytes", 2 << 30),
    "engine.tierLoadTimeoutSeconds": ("engine.tierLoadTimeoutSeconds=2", "engine.tier_load_timeout_s", 2.0),
    "engine.kvCacheDtype": ("engine.kvCacheDtype=bfloat16", "engine.kv_cache_dtype", "bfloat16"),
    "engine.diskTierSize": ("engine.diskTierSize=8GiB", "engine.disk_tier_bytes", 8 << 30),  # with a host tier
    "engine.hostTierShared": ("engine.hostTierShared=true", "engine.host_tier_shared", True),  # with a host tier
    "engine.tierPolicy": ("engine.tierPolicy=arc", "engine.tier_policy", "arc"),  # with a host tier
    "engine.lora.enabled": ("engine.lora.enabled=true", "engine.lora.enabled", True),
    "engine.lora.maxLoaded": ("engine.lora.maxLoaded=4", "engine.lora.max_loaded", 4),
    "engine.lora.maxRank": ("engine.lora.maxRank=32", "engine.lora.max_rank", 32),
    "speculative.method": ("speculative.method=ngram", "speculative.method", "ngram"),
    "speculative.numSpeculativeTokens": ("speculative.numSpeculativeTokens=7", "speculative.num_speculative_tokens", 7),
    "speculative.adaptive": ("speculative.adaptive=false", "speculative.adaptive", False),
    "speculative.ngramMin": ("speculative.ngramMin=2", "speculative.ngram_min", 2),
    "speculative.ngramMax": ("speculative.ngramMax=6", "speculative.ngram_max", 6),
    "speculative.draftModel": ("speculative.draftModel=/models/draft", "speculative.draft_model", "/models/draft"),
    "speculative.draftQuantization": ("speculative.draftQuantization=int8", "speculative.draft_quantization", "int8"),
    "speculative.drafterCpus": ("speculative.drafterCpus=3", "speculative.drafter_cpus", 3),
    "speculative.drafterResources": ("speculative.drafterResources.fast_cpu=2", "speculative.drafter_resources",
                                     {"fast_cpu": 2}),
    # --set parses integers and booleans, not floats: 3 stands for any number of seconds
    "speculative.draftTimeoutSeconds": ("speculative.draftTimeoutSeconds=3", "speculative.draft_timeout_s", 3.0),
    "speculative.overlap": ("speculative.overlap=false", "speculative.overlap", False),
    "speculative.drafterDevice": ("speculative.drafterDevice=cpu", "speculative.drafter_device", "cpu"),
    # a drafter pool's values (the test renders a target naming a drafter pool that sets them)
    "speculative.drafterPool": ("speculative.drafterPool=drafters", "speculative.drafter_pool", "drafters"),
    "drafter.model": ("drafter.model=/models/draft", "drafter.model", "/models/draft"),
    "drafter.quantization": ("drafter.quantization=q4", "drafter.quantization", "q4"),
    "drafter.threads": ("drafter.threads=3", "drafter.threads", 3),
    "drafter.idleTimeoutSeconds": ("drafter.idleTimeoutSeconds=7", "drafter.idle_timeout_s", 7.0),
}
# A colocated pool drafting on a drafter pool (the drafter.* values are set on pools[1])
DRAFTER_POOL = ["pools[0].name=main", "pools[0].role=colocated", "pools[0].speculative.method=draft_model",
                "pools[0].speculative.drafterPool=drafters", "pools[1].name=drafters", "pools[1].role=drafter",
                "pools[1].drafter.model=/models/draft"]
P0 = ["pools[0].name=p"]
DRAFT = ["poolDefaults.speculative.method=draft_model", "poolDefaults.speculative.draftModel=/m/d"]
POD_ONLY = {"minReplicas", "maxReplicas", "memoryPerRank", "nodeSelector", "tolerations", "affinity"}
NOT_YET_USED: set[str] = set()  # the README and NOTES say so (test_chart_readme.py)
AUTOSCALING = {"slo", "profile", "maxStandby"}  # reach autoscaling.pools[] with autoscaling.duet
# (test_chart_autoscaling.py, test_chart_coldstart.py)
FREE_FORM = {"slo", "profile", "nodeSelector", "affinity", "drafterResources"}  # maps that are one value each


def _leaves(values: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in FREE_FORM:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


def _attr(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return dict(obj) if name in ("drafter_resources", "resources_per_rank") else obj


def _render(helm, *sets: str) -> dict[str, list[dict]]:
    return by_kind(render(helm, None, *sets))


def _groups(kinds) -> dict[str, dict]:
    return {g["groupName"]: g for g in one(kinds, "RayCluster")["spec"]["workerGroupSpecs"]}


def test_every_pool_value_is_accounted_for():
    leaves = _leaves(yaml.safe_load((CHART / "values.yaml").read_text())["poolDefaults"])
    unaccounted = leaves - set(REACHES_CONFIG) - POD_ONLY - NOT_YET_USED - AUTOSCALING
    assert not unaccounted, f"poolDefaults values neither reaching the config nor pod-only: {sorted(unaccounted)}"
    assert not set(REACHES_CONFIG) - leaves, "REACHES_CONFIG names values that no longer exist"


@pytest.mark.parametrize("key", list(REACHES_CONFIG))
def test_pool_value_reaches_its_config_key(helm, tmp_path, key):
    assignment, attr, expected = REACHES_CONFIG[key]
    if key == "speculative.drafterPool" or key.startswith("drafter."):
        pool = 0 if key.startswith("speculative.") else 1
        config = loaded_config(_render(helm, *DRAFTER_POOL, f"pools[{pool}].{assignment}"), tmp_path)
        assert _attr(config.pools[pool], attr) == expected
        return
    sets = [f"poolDefaults.{assignment}"]
    if key.startswith("speculative.") and key != "speculative.method":
        sets.append("poolDefaults.speculative.method=ngram")  # options of a speculating pool
    if key in ("engine.diskTierSize", "engine.hostTierShared", "engine.tierPolicy"):
        sets.append("poolDefaults.engine.hostTierMemory=1GiB")  # the disk tier sits below a host tier
    config = loaded_config(_render(helm, *sets), tmp_path)
    assert _attr(config.pool, attr) == expected


def test_kv_tiers_default_to_an_auto_host_tier_and_no_disk(helm, tmp_path):
    """The chart's defaults: the host tier on, sized by the worker (``auto``: workers/kv/tiers/budget.py),
    the disk tier off; hostTierMemory "0" turns the host tier off."""
    engine = loaded_config(_render(helm), tmp_path).pool.engine
    assert (engine.host_tier_bytes, engine.disk_tier_bytes) == ("auto", 0)
    off = loaded_config(_render(helm, "poolDefaults.engine.hostTierMemory=0"), tmp_path).pool.engine
    assert off.host_tier_bytes == 0


def test_a_replica_is_one_pod_holding_its_gang(helm, tmp_path):
    """ep 2 x sp 1 x tp 3 = 6 ranks of 3 CPUs, 1 GPU and 5Gi each: one 18-CPU, 6-GPU, 30Gi pod with 6
    duet_pool_default slots per replica, and Ray's autoscaler sees exactly the room for the pool's 2 x 6
    bundles in 2 pods."""
    kinds = _render(helm, "image.variant=cuda", "poolDefaults.replicas=2",
                    "poolDefaults.epSize=2", "poolDefaults.tpSize=3", "poolDefaults.cpusPerRank=3",
                    "poolDefaults.gpusPerRank=1", "poolDefaults.memoryPerRank=5Gi")
    pool = loaded_config(kinds, tmp_path).pool
    assert (pool.gang_size, pool.cpus_per_replica, pool.replicas) == (6, 3, 2)
    group = _groups(kinds)["default"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 4)  # the default pool's own max
    assert group["rayStartParams"] == {"num-cpus": "18", "num-gpus": "6", "resources": '"{\\"duet_pool_default\\": 6}"'}
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "18", "memory": "30Gi", "nvidia.com/gpu": "6"}
    assert resources["limits"] == {"memory": "30Gi", "nvidia.com/gpu": "6"}
    offered = ray_node_types(kinds)["default"]["resources"]
    bundle = rank_bundle(pool)  # what each of the pool's replicas x gang ranks reserves
    assert bundle == {"CPU": 3, "GPU": 1.0, "duet_pool_default": 1}
    for name, amount in bundle.items():  # a pod holds exactly one gang
        assert offered[name] == pool.gang_size * amount
    assert offered["memory"] == 30 << 30


def test_drafters_group_and_drafter_resources_meet(helm, tmp_path):
    """With drafters.enabled, a draft_model pool's drafter actors ask for the resource only the
    drafters group offers (one unit per CPU), so Ray places them there and nowhere else."""
    sets = ("drafters.enabled=true", "drafters.cpusPerPod=6", "drafters.rayResource=cpu_drafter",
            "drafters.replicas=2", "drafters.maxReplicas=5", "drafters.nodeSelector.pool=cpu",
            "poolDefaults.speculative.method=draft_model", "poolDefaults.speculative.draftModel=/models/d",
            "poolDefaults.speculative.drafterCpus=2")
    kinds = _render(helm, *sets)
    spec = loaded_config(kinds, tmp_path).pool.speculative
    assert dict(spec.drafter_resources) == {"cpu_drafter": 2} and spec.drafter_cpus == 2
    node_types = ray_node_types(kinds)
    offering = [name for name, t in node_types.items() if "cpu_drafter" in t["resources"]]
    assert offering == ["drafters"]
    drafters = node_types["drafters"]
    assert drafters["resources"]["cpu_drafter"] == drafters["resources"]["CPU"] == 6 and "GPU" not in drafters["resources"]
    assert (drafters["min_workers"], drafters["max_workers"]) == (2, 5)
    group = _groups(kinds)["drafters"]
    assert group["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "duet.ai/pool" not in group["template"]["metadata"]["labels"]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"] == {"memory": "16Gi"}


def test_each_pool_group_offers_only_its_own_resource(helm, tmp_path):
    """Three pools (a GPU prefill gang, a CPU decode pool, a second decode pool) and the drafters: each
    pool's ConfigMap entry asks for its own resource, exactly its own group offers it, and Ray's
    autoscaler bin-packing (what KubeRay's autoscaler does with pending bundles) fits the pool's
    bundles onto its own group's pods and onto no other group's -- while a CPU-only bundle, the
    shape before per-pool resources, would have fitted onto another group's pods too."""
    from ray.autoscaler._private.resource_demand_scheduler import get_bin_pack_residual

    kinds = _render(helm, "image.variant=cuda", "drafters.enabled=true", "drafters.cpusPerPod=8",
                    "pools[0].name=pre", "pools[0].role=prefill", "pools[0].tpSize=2", "pools[0].gpusPerRank=1",
                    "pools[0].replicas=2", "pools[1].name=dec", "pools[1].role=decode", "pools[1].maxReplicas=3",
                    "pools[2].name=dec_long", "pools[2].role=decode", "pools[2].cpusPerRank=4")
    config = loaded_config(kinds, tmp_path)
    node_types = ray_node_types(kinds)
    standard = {"CPU", "GPU", "memory", "object_store_memory"}
    custom = {group: {k: v for k, v in t["resources"].items() if k not in standard} for group, t in node_types.items()}
    assert custom == {"headgroup": {}, "pre": {"duet_pool_pre": 2}, "dec": {"duet_pool_dec": 1},
                      "dec-long": {"duet_pool_dec_long": 1}, "drafters": {"drafter": 8}}
    for pool in config.pools:
        own = pool.name.replace("_", "-")
        assert dict(pool.resources_per_rank) == {f"duet_pool_{pool.name}": 1}
        assert pool.gpus_per_rank == (1 if pool.name == "pre" else 0)
        bundles = [rank_bundle(pool) for _ in range(pool.replicas * pool.gang_size)]
        pods = [dict(node_types[own]["resources"]) for _ in range(node_types[own]["max_workers"])]  # one dict each
        assert get_bin_pack_residual(pods, bundles)[0] == [], f"{pool.name}: its bundles do not fit its own pods"
        others = [dict(t["resources"]) for g, t in node_types.items() if g != own for _ in range(8)]
        assert get_bin_pack_residual(others, bundles)[0] == bundles, f"{pool.name}: bundles fit another group"
        cpu_only = [{"CPU": pool.cpus_per_replica} for _ in bundles]
        assert get_bin_pack_residual(others, cpu_only)[0] == [], "control: CPU-only bundles fit elsewhere"


@pytest.mark.parametrize(("sets", "expected"), [
    ([*DRAFT, "drafters.enabled=true"], {"drafter": 1}),  # the chart's default: drafterCpus units
    (DRAFT, {}),  # no drafters group: the drafter takes CPUs wherever Ray finds them
    ([*DRAFT, "drafters.enabled=true", "poolDefaults.speculative.drafterResources.gpu_box=1"], {"gpu_box": 1}),  # the pool's own
    (["drafters.enabled=true", "poolDefaults.speculative.method=ngram"], {}),  # prompt lookup: no drafter actor
])
def test_drafter_resources_default_only_where_drafters_serve_a_draft_model(helm, tmp_path, sets, expected):
    spec = loaded_config(_render(helm, *sets), tmp_path).pool.speculative
    assert dict(spec.drafter_resources) == expected


def test_disaggregated_pools_keep_their_own_settings(helm, tmp_path):
    """Pools merge over poolDefaults one by one: the prefill pool keeps speculation off while the
    decode pool turns it on, and each gets its own worker group, sizes and node placement."""
    pools = ["pools[0].name=pre", "pools[0].role=prefill", "pools[0].tpSize=2", "pools[0].gpusPerRank=1",
             "pools[0].nodeSelector.gpu=l4", "pools[1].name=dec", "pools[1].role=decode", "pools[1].replicas=3",
             "pools[1].speculative.method=ngram", "pools[1].tolerations[0].key=spot",
             "pools[1].tolerations[0].operator=Exists", "image.variant=cuda"]
    kinds = _render(helm, *pools)
    config = loaded_config(kinds, tmp_path)
    pre, dec = config.pools
    assert (pre.role, pre.tp_size, pre.replicas, pre.speculative.method) == ("prefill", 2, 1, "none")
    assert (dec.role, dec.tp_size, dec.replicas, dec.speculative.method) == ("decode", 1, 3, "ngram")
    groups = _groups(kinds)
    assert groups["pre"]["rayStartParams"] == {"num-cpus": "4", "num-gpus": "2", "resources": '"{\\"duet_pool_pre\\": 2}"'}
    assert groups["pre"]["template"]["spec"]["nodeSelector"] == {"gpu": "l4"}
    assert "tolerations" not in groups["pre"]["template"]["spec"]
    assert groups["dec"]["template"]["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert groups["dec"]["replicas"] == 3 and "num-gpus" not in groups["dec"]["rayStartParams"]


@pytest.mark.parametrize(("sets", "message"), [
    # the schema
    (["poolDefaults.replicas=0"], "at '/poolDefaults/replicas': minimum: got 0, want 1"),
    (["pools[0].name=default", "pools[0].role=expert"], "at '/pools/0/role': value must be one of 'colocated', 'prefill', 'decode', 'drafter'"),
    (["pools[0].name=d", "pools[0].role=drafter", "pools[0].drafter.model=/m/d"],
     "pools: roles [drafter]: needs a colocated or decode pool"),
    (["pools[0].name=Default", "pools[0].role=colocated"], "at '/pools/0/name'"),
    ([*P0, "pools[0].role=colocated", "pools[0].epSize=0"], "at '/pools/0/epSize': minimum: got 0, want 1"),
    (["poolDefaults.tpSize=0"], "at '/poolDefaults/tpSize': minimum: got 0, want 1"),
    (["poolDefaults.spSize=-1"], "at '/poolDefaults/spSize': minimum: got -1, want 1"),
    ([*P0, "pools[0].role=prefill", "pools[0].speculative.method=ngram", "pools[1].name=d", "pools[1].role=decode"],
     "at '/pools/0/speculative/method': value must be 'none'"),
    (["poolDefaults.speculative.method=medusa"], "at '/poolDefaults/speculative/method': value must be one of 'none', 'ngram', 'draft_model'"),
    (["poolDefaults.speculative.numSpeculativeTokens=17"], "at '/poolDefaults/speculative/numSpeculativeTokens': maximum: got 17, want 16"),
    (["poolDefaults.speculative.drafterResources.drafter=0"], "at '/poolDefaults/speculative/drafterResources/drafter'"),
    (["poolDefaults.speculative.draftQuantization=q3"], "at '/poolDefaults/speculative/draftQuantization'"),
    (["poolDefaults.speculative.colour=red"], "additional properties 'colour' not allowed"),
    (["poolDefaults.memoryPerRank=4G"], "at '/poolDefaults/memoryPerRank'"),
    (["model.quantization=q8"], "at '/model/quantization': value must be one of 'none', 'int8', 'q4'"),
    (["drafters.rayResource=CPU"], "at '/drafters/rayResource'"),
    (["drafters.rayResource=has space"], "at '/drafters/rayResource'"),
    (["drafters.rayResource=duet_pool_default"], "at '/drafters/rayResource'"),  # the pools' own
    (["poolDefaults.replicas=-1"], "at '/poolDefaults/replicas': minimum: got -1, want 1"),
    (["router.port=70000"], "at '/router/port': maximum: got 70,000, want 65,535"),
    (["router.policy=fastest"], "at '/router/policy': value must be one of"),
    (["router.colour=blue"], "additional properties 'colour' not allowed"),
    (["model.dtype=int3"], "at '/model/dtype'"),
    (["poolDefaults.engine.kvCacheMemory=lots"], "at '/poolDefaults/engine/kvCacheMemory'"),
    (["router.maxRequestBytes=lots"], "at '/router/maxRequestBytes'"),
    # the chart's cross-field checks (values merged from poolDefaults, sums over pools)
    ([*P0, "pools[0].role=prefill", "pools[1].name=d", "pools[1].role=decode", "poolDefaults.speculative.method=ngram"],
     "pools[0] (p): speculative.method=ngram: a prefill pool produces one token per request; speculate on the decode pool"),
    ([*P0, "pools[0].role=prefill"], "needs a colocated or decode pool to stream tokens"),
    (["poolDefaults.speculative.method=draft_model"],
     "pools[0] (default): speculative.method=draft_model needs speculative.draftModel"),
    (["poolDefaults.speculative.ngramMin=5"], "speculative.ngramMin=5 must be <= speculative.ngramMax=4"),
    (["drafters.enabled=true", "drafters.cpusPerPod=2", "poolDefaults.speculative.drafterCpus=4", *DRAFT],
     "speculative.drafterCpus=4 exceeds drafters.cpusPerPod=2: no drafter pod could hold a drafter"),
    (["drafters.enabled=true", "pools[0].name=drafters", "pools[0].role=colocated"],
     'the worker group name "drafters" belongs to drafters.enabled'),
    (["drafters.enabled=true", "drafters.replicas=5", "drafters.maxReplicas=2"], "drafters: replicas=5 must be <= maxReplicas=2"),
    ([*P0, "pools[0].role=prefill", "pools[0].engine.blockSize=32", "pools[1].name=d", "pools[1].role=decode"],
     "pools: engine.blockSize differs between pools ([32 16])"),
    (["poolDefaults.epSize=2", "poolDefaults.placementStrategy=STRICT_SPREAD"],
     "pools[0] (default): placementStrategy=STRICT_SPREAD puts each of the pool's 1 x 2 rank bundles on its own node"),
    (["poolDefaults.replicas=2", "poolDefaults.placementStrategy=STRICT_PACK"],
     "placementStrategy=STRICT_PACK puts every bundle of the pool on one node, but each of its up to 4 replicas"),
    (["model.quantization=int8", "model.dtype=bfloat16"], "model.quantization=int8 needs model.dtype=float32"),
    ([*DRAFT, "poolDefaults.speculative.draftQuantization=q4", "model.dtype=bfloat16"],
     "pools[0] (default): speculative.draftQuantization=q4 with model.dtype=bfloat16: the drafter runs with the "
     "target's dtype"),
    (["pools[0].name=default", "pools[0].role=colocated", "pools[0].replicas=5", "pools[0].maxReplicas=2"],
     "pools[0] (default): replicas=5 must be between minReplicas=5 and maxReplicas=2"),
    (["pools[0].name=a", "pools[0].role=colocated", "pools[1].name=a", "pools[1].role=decode"],
     'pools[1].name="a": pool names must be unique'),
    (["serviceMonitor.enabled=true", "router.metrics.enabled=false", "autoscaling.duet.enabled=false"],
     "serviceMonitor.enabled=true needs"),
    (["poolDefaults.engine.maxNumSeqs=600"], "engine.maxNumSeqs=600 must be <= engine.maxNumBatchedTokens=512"),
    (["router.tls.secretName=tls"], "router.tls.serverName: required with router.tls.secretName"),
    (["router.tls.requireClientCerts=true"], "router.tls.requireClientCerts=true needs router.tls.secretName"),
    ([*DRAFTER_POOL, "pools[1].drafter.model=null"], "pools[1] (drafters): role drafter needs drafter.model"),
    ([*DRAFTER_POOL, "pools[0].speculative.drafterPool=nope"],
     "pools[0] (main): speculative.drafterPool=nope must name a pool with role drafter (drafter pools: [drafters])"),
    ([*DRAFTER_POOL, "pools[0].speculative.method=none", "pools[0].speculative.drafterPool=null"],
     "pools[1] (drafters): no pool's speculative.drafterPool names this drafter pool"),
    ([*DRAFTER_POOL, "pools[1].tpSize=2"], "pools[1] (drafters): role drafter with a gang of 2 ranks"),
    ([*DRAFTER_POOL, "pools[0].drafter.model=/m/x"], "pools[0] (main): drafter.model=/m/x: only a role: drafter pool"),
    ([*DRAFTER_POOL, "pools[0].speculative.draftModel=/m/y"],
     "pools[0] (main): speculative.drafterPool=drafters needs speculative.method: draft_model and no speculative.draftModel"),
])
def test_bad_values_are_rejected_with_a_clear_message(helm, sets, message):
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    r = run_helm(helm, *args)
    assert r.returncode != 0, f"rendered: {sets}"
    assert message in r.stderr, r.stderr


def test_worker_pods_drain_by_live_migration_before_they_stop(helm):
    """Every pool's worker pods (not drafter pods) get a preStop hook running `duet drain` for the
    pod's IP, with a termination grace that covers it; workerDrain.enabled=false removes it."""
    objs = by_kind(render(helm, CHART / "ci" / "disaggregated-values.yaml", "workerDrain.timeoutSeconds=45"))
    groups = one(objs, "RayCluster", f"{RELEASE}-duet")["spec"]["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} >= {"drafters"} and len(groups) >= 3
    for g in groups:
        pod = g["template"]["spec"]
        container = pod["containers"][0]
        if g["groupName"] == "drafters":
            assert "lifecycle" not in container and "terminationGracePeriodSeconds" not in pod
            continue
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["/bin/sh", "-c"]
        assert 'duet drain --node-ip "$DUET_POD_IP" --timeout 45' in command[2]
        env = {e["name"]: e for e in container["env"]}
        assert env["DUET_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert pod["terminationGracePeriodSeconds"] == 75
    off = by_kind(render(helm, None, "workerDrain.enabled=false"))
    for g in one(off, "RayCluster", f"{RELEASE}-duet")["spec"]["workerGroupSpecs"]:
        assert "lifecycle" not in g["template"]["spec"]["containers"][0]
    r = run_helm(helm, "template", RELEASE, str(CHART), "--set", "workerDrain.timeoutSeconds=0")
    assert r.returncode != 0 and "/workerDrain/timeoutSeconds" in r.stderr
