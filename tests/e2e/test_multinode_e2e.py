"""Duet on a real multi-node Ray cluster (tests/testkit/multinode.py): a head without CPUs (the
driver: router, controller, membership service) and five worker nodes, each its own raylet, object
store and worker processes, with the custom resources the Helm chart gives its worker groups:

    a, b, c   {CPU: 2, duet_pool_main: 1000, duet_pool_prefill: 1000}   the pools' nodes
    d         {CPU: 2, duet_drafter: 1000}                               the drafter node
    e         {CPU: 1, duet_pool_decode: 1000}                           the decode node

``duet serve`` joins it with ``ray.address`` (cluster.deploy.serve.start_deployment), as it joins a real
cluster, and every behaviour is driven end to end through the router's public gRPC API with a tiny
random-weight model (greedy references from the in-process engine). Three deployments, one after
the other, share the cluster:

    spec    pool ``main``: 2 replicas SPREAD on duet_pool_main, each with a drafter actor on
            duet_drafter. Placement; a serving worker's node removed mid-stream (Ray re-places it
            on a node with room); the same with no room left (pending until a node returns); the
            drafter node removed.
    pool    pool ``main``: 1 replica on duet_pool_main drafting on pool ``drafters`` (role:
            drafter, 1 replica on duet_drafter, the same model). The drafter's node removed while
            streams draft on it: every stream completes identically, fallbacks counted; the pool
            comes back with the node and drafting resumes.
    pd      pool ``prefill``: 2 replicas PACK on duet_pool_prefill; pool ``decode``: 1 replica on
            duet_pool_decode. Placement; the prefill node removed while a request is in prefill
            (retried colocated on the decode worker, router/policies/disagg.py).
    tp      pool ``main``: 1 replica, a tp_size=2 gang SPREAD over two nodes. One rank's node
            removed mid-stream; the gang re-forms.

After every test the removed nodes come back (a replacement pod), the deployment returns to full
size, and nothing is leaked: no KV block in use, no decode reservation, no request left running, no
drafter state (requests, KV blocks, rounds in flight), no placement group pending or rescheduling. After each deployment stops: no actor of its namespace
and every placement group REMOVED. The bad-input check (a STRICT_SPREAD pool on too few nodes)
needs no workers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import ray

from cluster.config.duet import load_config
from cluster.deploy.pools import PoolError
from cluster.deploy.ray_actuator import RayActuator
from cluster.deploy.serve import Deployment, start_deployment
from cluster.deploy.status import format_status, worker_status
from protos.duet.drafter.v1 import drafter_pb2, drafter_pb2_grpc
from protos.duet.worker.v1 import worker_pb2, worker_pb2_grpc
from router.client import DuetClient, DuetError
from testkit.multinode import NODE_RESOURCE, LocalCluster
from testkit.tp_cases import save_tiny_qwen2
from testkit.waiting import wait_until as _wait

# Its own pytest process (`make test` runs `-m serial` after the rest): a multi-node cluster's Ray
# settings stay in the process that started it, and a later `ray.init` there times out.
pytestmark = pytest.mark.serial

MAIN, PREFILL, DECODE, DRAFTER = "duet_pool_main", "duet_pool_prefill", "duet_pool_decode", "duet_drafter"
NODES = {"a": (2, {MAIN: 1000, PREFILL: 1000}), "b": (2, {MAIN: 1000, PREFILL: 1000}),
         "c": (2, {MAIN: 1000, PREFILL: 1000}), "d": (2, {DRAFTER: 1000}), "e": (1, {DECODE: 1000})}
PROMPT = [1, 504, 3575, 282, 4649, 314, 2023, 30]
LONG_PROMPT = PROMPT * 75  # 600 tokens: disaggregated (router.disagg_min_prompt_tokens below)
PD_CHUNK = 4  # the P/D pools' tokens per step: a long prompt's prefill takes 150 steps, so the node can go mid-prefill
STREAM_TOKENS = 280  # long enough to be mid-stream when the node goes
SHORT_TOKENS = 24
KV_BYTES = 16 << 20
ROUTER = dict(load_poll_interval_s=0.1, load_poll_timeout_s=2.0, stream_failure_cooldown_s=0.3)


# ------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny") / "qwen2", smollm2_path, seed=3, num_hidden_layers=4,
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of the in-process engine, by (prompt length, max_tokens)."""
    from workers.llm import LLM
    from workers.sampling_params import SamplingParams

    out = {}
    for prompt, n, chunk in ((PROMPT, STREAM_TOKENS, None), (PROMPT, SHORT_TOKENS, None),
                             (LONG_PROMPT, SHORT_TOKENS, PD_CHUNK)):  # prefill in the P/D pools' chunks
        llm = LLM(str(tiny_model), kv_cache_memory_bytes=KV_BYTES, **({"max_num_batched_tokens": chunk} if chunk else {}))
        [o] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out[(len(prompt), n)] = list(o.token_ids)
    return out


@pytest.fixture(scope="module")
def cluster(session_ray_paused):
    c = LocalCluster()
    try:
        for name, (cpus, resources) in NODES.items():
            c.add(name, cpus, resources)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _deploy(cluster: LocalCluster, model: Path, tmp: Path, namespace: str, pools_yaml: str, **overrides) -> Deployment:
    path = tmp / "duet.yaml"
    path.write_text(pools_yaml)
    config = load_config(path, env={}, overrides={
        "model.name": str(model), "ray.address": cluster.address, "ray.namespace": namespace,
        "router.port": 0, "router.http_port": 0, "controller.port": 0, "router.policy": "least_loaded",
        "controller.poll_interval_s": 0.2, "controller.start_timeout_s": 120, **overrides})
    return start_deployment(config, router_overrides=ROUTER, log_to_driver=False)


def _pool_yaml(name: str, role: str, replicas: int, strategy: str, resource: str, extra: str = "",
               engine: str = "") -> str:
    return (f"  - {{name: {name}, role: {role}, replicas: {replicas}, cpus_per_replica: 1, placement_strategy: "
            f"{strategy}, resources_per_rank: {{{resource}: 1}}, engine: {{kv_cache_memory_bytes: {KV_BYTES}, "
            f"block_size: 8{engine}}}{extra}}}\n")


DRAFTING = (", speculative: {method: draft_model, draft_model: '{model}', num_speculative_tokens: 3, adaptive: false, "
            "overlap: false, draft_timeout_s: 5, drafter_resources: {" + DRAFTER + ": 1}}")
POOL_DRAFTING = (", speculative: {method: draft_model, drafter_pool: drafters, num_speculative_tokens: 3, "
                 "adaptive: false, draft_timeout_s: 5}")
DEPLOYMENTS = {  # name -> (pools YAML, config overrides); {model}: the tiny checkpoint
    "spec": ("pools:\n" + _pool_yaml("main", "colocated", 2, "SPREAD", MAIN, DRAFTING), {}),
    "pool": ("pools:\n" + _pool_yaml("main", "colocated", 1, "SPREAD", MAIN, POOL_DRAFTING)
             + _pool_yaml("drafters", "drafter", 1, "SPREAD", DRAFTER, ", drafter: {model: '{model}'}"), {}),
    "pd": ("pools:\n" + _pool_yaml("prefill", "prefill", 2, "PACK", PREFILL, engine=f", max_num_batched_tokens: {PD_CHUNK}")
           + _pool_yaml("decode", "decode", 1, "SPREAD", DECODE, engine=f", max_num_batched_tokens: {PD_CHUNK}"),
           {"router.disagg_min_prompt_tokens": 64}),
    "tp": ("pools:\n" + _pool_yaml("main", "colocated", 1, "SPREAD", MAIN, ", tp_size: 2"), {}),
}


class Deployments:
    """One deployment at a time on the shared cluster: asking for another stops the current one
    first and checks it left nothing (no actor in its namespace, every placement group REMOVED)."""

    def __init__(self, cluster: LocalCluster, model: Path, tmp: Path) -> None:
        self.cluster, self.model, self.tmp = cluster, model, tmp
        self.name: str | None = None
        self.d: Deployment | None = None

    def get(self, name: str) -> Deployment:
        if self.name != name:
            self.close()
            pools_yaml, overrides = DEPLOYMENTS[name]
            (self.tmp / name).mkdir()
            self.d = _deploy(self.cluster, self.model, self.tmp / name, f"duet_nodes_{name}",
                             pools_yaml.replace("{model}", str(self.model)), **overrides)
            self.name = name
            self.expected = sum(len(p.replicas) for p in self.d.pools)
        return self.d

    def close(self) -> None:
        if self.d is None:
            return
        d, namespace, self.d, self.name = self.d, self.d.config.ray.namespace, None, None
        groups = [p.placement_group for p in d.pools]
        d.stop()
        ray.init(address=self.cluster.address, log_to_driver=False)  # d.stop() disconnected its driver
        try:
            _wait(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                               if a["namespace"] == namespace], 30, f"the actors of {namespace} to be gone")
            assert [ray.util.placement_group_table(pg)["state"] for pg in groups] == ["REMOVED"] * len(groups)
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def deployments(cluster, tiny_model, reference, tmp_path_factory):
    ds = Deployments(cluster, tiny_model, tmp_path_factory.mktemp("deployments"))
    yield ds
    ds.close()


@pytest.fixture
def healed(request, cluster, deployments):
    """Deployment ``request.param`` for the test; afterwards bring removed nodes back, wait for
    the deployment to be whole again and assert nothing leaked."""
    d = deployments.get(request.param)
    yield d
    cluster.restore()
    _wait(lambda: len(d.controller.members()) == deployments.expected, 120, "every replica back up")
    _wait(lambda: all(ray.util.placement_group_table(p.placement_group)["state"] == "CREATED" for p in d.pools),
          60, "every placement group placed")
    _wait(lambda: all(_member_idle(d, w, ep) for w, ep in d.controller.members()), 30, "every worker idle")
    assert _leaks(d) == []


# --------------------------------------------------------------------------------------- helpers
def _load(endpoint: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(endpoint) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _idle(r: worker_pb2.LoadReport) -> bool:
    return r.kv_blocks_used == 0 and r.num_reserved == 0 and r.num_running == 0 and r.num_waiting == 0


def _drafter_load(endpoint: str) -> drafter_pb2.DrafterLoad:
    with grpc.insecure_channel(endpoint) as channel:
        return drafter_pb2_grpc.DrafterStub(channel).GetLoad(drafter_pb2.GetDrafterLoadRequest(), timeout=5)


def _drafter_idle(r: drafter_pb2.DrafterLoad) -> bool:
    return r.num_requests == 0 and r.num_active == 0 and r.kv_blocks_used == 0


def _is_drafter(d: Deployment, worker_id: str) -> bool:
    return any(p.section.role == "drafter" and any(r.worker_id == worker_id for r in p.replicas) for p in d.pools)


def _member_idle(d: Deployment, worker_id: str, endpoint: str) -> bool:
    return _drafter_idle(_drafter_load(endpoint)) if _is_drafter(d, worker_id) else _idle(_load(endpoint))


def _leaks(d: Deployment) -> list[str]:
    out = [f"{w}: {_drafter_load(ep) if _is_drafter(d, w) else _load(ep)}" for w, ep in d.controller.members()
           if not _member_idle(d, w, ep)]
    out += [f"{pg_id}: {t['state']}" for pg_id, t in ray.util.placement_group_table().items()
            if t["state"] in ("PENDING", "RESCHEDULING")]
    return out


def _nodes_of(d: Deployment, cluster: LocalCluster, pool: str) -> dict[str, list[str | None]]:
    """worker id -> the names of the nodes holding its ranks' bundles (rank order; None: unplaced)."""
    p = next(p for p in d.pools if p.name == pool)
    return {r.worker_id: [cluster.name_of(n) for n in p.bundle_nodes(r)] for r in list(p.replicas)}


def _drafter_nodes(cluster: LocalCluster) -> list[str | None]:
    """Where the live drafter actors run (Ray's actor table: they are no pool's and have no name)."""
    table = ray._private.state.actors(actor_state_name="ALIVE").values()
    return sorted(cluster.name_of(a["Address"]["NodeID"]) for a in table if a["ActorClassName"] == "DrafterActor")


async def _stream(address: str, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None,
                  after: int = 8) -> list[int]:
    async with DuetClient(address) as client:
        out: list[int] = []
        async for chunk in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                           timeout=180):
            out += chunk.token_ids
            if started is not None and len(out) >= after:
                started.set()
        return out


async def _remove_mid_stream(d: Deployment, cluster: LocalCluster, pick_node) -> tuple[list[int], str, float]:
    """Stream STREAM_TOKENS; once tokens flow, remove the node ``pick_node(serving worker id)``
    names. Returns (tokens, removed node, seconds from removal to the stream's end)."""
    started = asyncio.Event()
    task = asyncio.ensure_future(_stream(d.address, PROMPT, STREAM_TOKENS, started))
    await asyncio.wait_for(started.wait(), 60)
    busy = [w for w, ep in d.controller.members() if _load(ep).num_running > 0]
    assert len(busy) == 1, busy
    node = pick_node(busy[0])
    await asyncio.to_thread(cluster.remove, node)
    removed = time.monotonic()
    tokens = await task
    return tokens, node, time.monotonic() - removed


def _stats(d: Deployment) -> dict:
    return d.router.stats()["requests"]


def _failures(d: Deployment) -> int:
    """Requests the router ended with an error, or that failed mid-stream."""
    return sum(v for k, v in _stats(d).items() if k.startswith("error_") or k == "failed_mid_stream")


# ----------------------------------------------------------------------------- bad input: no workers
def test_strict_spread_pool_on_too_few_nodes_names_the_pool_and_the_shortfall(cluster, tiny_model, tmp_path):
    start = time.monotonic()
    with pytest.raises(PoolError) as err:
        _deploy(cluster, tiny_model, tmp_path, "duet_nodes_strict",
                "pools:\n" + _pool_yaml("wide", "colocated", 4, "STRICT_SPREAD", MAIN),
                **{"controller.placement_timeout_s": 1})
    assert time.monotonic() - start < 30
    msg = str(err.value)
    assert f"pool 'wide': placement_strategy STRICT_SPREAD needs 4 nodes that each offer {{CPU: 1, {MAIN}: 1}}" in msg
    assert "but 3 alive nodes do: " in msg and "add 1 such nodes" in msg, msg
    assert all(cluster.nodes[n].node_id[:8] in msg for n in "abc"), msg
    ray.init(address=cluster.address, log_to_driver=False)
    try:  # nothing reserved, nothing left
        assert {t["state"] for t in ray.util.placement_group_table().values()
                if t["name"].startswith("duet-duet_nodes_strict")} <= {"REMOVED"}
        assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "duet_nodes_strict"]
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------ spec: colocated + drafters
@pytest.mark.parametrize("healed", ["spec"], indirect=True)
def test_spread_and_resources_place_workers_and_drafters_on_their_nodes(healed, cluster, reference):
    d = healed
    nodes = _nodes_of(d, cluster, "main")
    assert sorted(nodes) == ["main-0", "main-1"]
    placed = [n for ns in nodes.values() for n in ns]
    assert len(set(placed)) == 2 and set(placed) <= {"a", "b", "c"}, nodes  # SPREAD, only duet_pool_main nodes
    out = asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS))
    assert out == reference[(len(PROMPT), SHORT_TOKENS)]
    workers = worker_status("duet_nodes_spec")
    assert sorted(cluster.name_of(w["node_id"]) for w in workers) == sorted(placed)  # duet status: each one's node
    loads = {w["worker_id"]: w["load"] for w in workers}
    assert sum(ld["spec_verifies"] for ld in loads.values()) > 0  # speculation ran
    assert _drafter_nodes(cluster) == ["d", "d"]  # drafter_resources: the drafter node only


@pytest.mark.parametrize("healed", ["spec"], indirect=True)
def test_node_loss_mid_stream_resumes_with_identical_tokens_and_the_pool_recovers(healed, cluster, reference):
    d = healed
    actuator = RayActuator(d.pools, d.controller)
    before = _nodes_of(d, cluster, "main")
    resumed = _stats(d).get("resumed", 0)
    tokens, node, _ = asyncio.run(_remove_mid_stream(d, cluster, lambda w: before[w][0]))
    assert tokens == reference[(len(PROMPT), STREAM_TOKENS)]
    assert _stats(d).get("resumed", 0) == resumed + 1
    lost = next(w for w, ns in before.items() if ns == [node])
    # Ray re-creates the lost worker on a node with room (SPREAD is best effort: any node offering
    # duet_pool_main); the controller starts it again and sees where it runs now
    _wait(lambda: actuator.status("main").ready == 2 and d.controller.num_restarts >= 1, 90, f"{lost} back")
    after = _nodes_of(d, cluster, "main")
    assert after[lost] != [node] and set(after[lost]) <= {"a", "b", "c"}, after
    assert {r["worker_id"]: cluster.name_of(r["node_id"]) for r in d.controller.describe()} == {
        w: ns[0] for w, ns in after.items()}
    assert asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS)) == reference[(len(PROMPT), SHORT_TOKENS)]
    status = format_status({"workers": worker_status("duet_nodes_spec")})
    assert f"node {cluster.nodes[after[lost][0]].node_id[:8]}" in status, status


@pytest.mark.parametrize("healed", ["spec"], indirect=True)
def test_without_room_the_lost_replica_is_pending_until_its_node_returns(healed, cluster, reference):
    # Another tenant holds the surviving node's free CPU; the worker's node and the spare node go: no
    # node is left with room for its bundle. The controller, duet status and the autoscaler's
    # actuator see it gone; the other replica serves meanwhile.
    from ray.util.placement_group import placement_group, remove_placement_group

    d = healed
    actuator = RayActuator(d.pools, d.controller)
    nodes = _nodes_of(d, cluster, "main")
    (lost, [node]), (_, [survivor]) = sorted(nodes.items())
    spare = ({"a", "b", "c"} - {node, survivor}).pop()
    tenant = placement_group([{"CPU": 1, NODE_RESOURCE.format(survivor): 0.5}])
    ray.get(tenant.ready(), timeout=30)
    try:
        cluster.remove(spare)
        cluster.remove(node)
        _wait(lambda: actuator.status("main").pending == 1, 30, f"{lost} pending")
        st = actuator.status("main")
        assert (st.ready, st.pending, st.capacity_replicas) == (1, 1, 1), st
        row = next(r for r in d.controller.describe() if r["worker_id"] == lost)
        assert row["state"] == "down" and f"its node {cluster.nodes[node].node_id[:8]} died" in row["last_error"], row
        assert [w for w, _ in d.controller.members()] != [lost] and len(d.controller.members()) == 1
        entry = next(w for w in worker_status("duet_nodes_spec", timeout=2) if w["worker_id"] == lost)
        assert "error" in entry, entry
        assert ray.util.placement_group_table(d.pool.placement_group)["state"] == "RESCHEDULING"
        assert asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS)) == reference[(len(PROMPT), SHORT_TOKENS)]
        cluster.restore()
        _wait(lambda: actuator.status("main").ready == 2, 120, f"{lost} back on a returned node")
        assert set(_nodes_of(d, cluster, "main")[lost]) <= {node, spare}
    finally:
        remove_placement_group(tenant)


@pytest.mark.parametrize("healed", ["spec"], indirect=True)
def test_drafter_node_loss_falls_back_to_plain_decoding_and_resumes(healed, cluster, reference):
    d = healed
    def spec_counts() -> tuple[int, int]:
        loads = [w["load"] for w in worker_status("duet_nodes_spec")]
        return sum(ld["spec_verifies"] for ld in loads), sum(ld["spec_fallbacks"] for ld in loads)

    cluster.remove("d")
    verifies, fallbacks = spec_counts()
    assert asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS)) == reference[(len(PROMPT), SHORT_TOKENS)]
    v2, f2 = spec_counts()
    assert f2 > fallbacks  # decoded without its drafter
    cluster.restore()
    def drafting_again() -> bool:
        v0, _ = spec_counts()
        out = asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS))
        assert out == reference[(len(PROMPT), SHORT_TOKENS)]
        return spec_counts()[0] > v0
    _wait(drafting_again, 90, "speculation to resume with a drafter on the restored node")
    assert _drafter_nodes(cluster) == ["d", "d"]


# ------------------------------------------------------------- pool: a target pool and a drafter pool
POOL_STREAMS = 4


@pytest.mark.parametrize("healed", ["pool"], indirect=True)
def test_drafter_pool_node_lost_under_load_costs_drafts_not_tokens_and_the_pool_recovers(healed, cluster, reference):
    d = healed
    assert _nodes_of(d, cluster, "drafters") == {"drafters-0": ["d"]}
    assert set(_nodes_of(d, cluster, "main")["main-0"]) <= {"a", "b", "c"}
    target = dict(d.controller.members())["main-0"]
    before, failures_before = _load(target), _failures(d)
    want_long, want_short = reference[(len(PROMPT), STREAM_TOKENS)], reference[(len(PROMPT), SHORT_TOKENS)]

    async def under_load() -> tuple[list[list[int]], list[list[int]], worker_pb2.LoadReport]:
        started = [asyncio.Event() for _ in range(POOL_STREAMS)]
        streams = [asyncio.ensure_future(_stream(d.address, PROMPT, STREAM_TOKENS, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        drafting = await asyncio.to_thread(_load, target)  # every stream has tokens, drafted on drafters-0
        await asyncio.to_thread(cluster.remove, "d")
        late = [asyncio.ensure_future(_stream(d.address, PROMPT, SHORT_TOKENS)) for _ in range(2)]  # no drafter left
        return await asyncio.gather(*streams), await asyncio.gather(*late), drafting

    long, short, drafting = asyncio.run(under_load())
    assert long == [want_long] * POOL_STREAMS and short == [want_short] * 2  # no token lost or changed
    after = _load(target)
    assert drafting.spec_verifies > before.spec_verifies  # they speculated on the pool before the loss
    assert after.spec_fallbacks > before.spec_fallbacks  # and went on without drafts after it
    assert _failures(d) == failures_before  # (the streams' tokens above already say so; the router agrees)
    _wait(lambda: _idle(_load(target)), 30, "the target to free every request")

    # the node returns: Ray re-creates the drafter there, the controller starts it again, the router
    # takes it back (a new incarnation) and requests draft on it again, leaving nothing behind
    cluster.restore()
    _wait(lambda: "drafters-0" in dict(d.controller.members()), 120, "drafters-0 back on the restored node")
    _wait(lambda: any(x["drafter_id"] == "drafters-0" and x["healthy"] for x in d.router.stats()["drafters"]),
          60, "the router to take drafters-0 back")
    assert _nodes_of(d, cluster, "drafters") == {"drafters-0": ["d"]}
    verifies = _load(target).spec_verifies
    assert asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS)) == want_short
    assert _load(target).spec_verifies > verifies  # drafting on the pool again
    drafter = dict(d.controller.members())["drafters-0"]
    _wait(lambda: _drafter_idle(_drafter_load(drafter)), 30, "the drafter to release the request")
    assert _drafter_load(drafter).num_streams <= 1  # one stream per (target, drafter) pair at most


# ---------------------------------------------------------------------------------- pd: P/D + PACK
@pytest.mark.parametrize("healed", ["pd"], indirect=True)
def test_pack_fills_one_node_and_pools_keep_to_their_nodes(healed, cluster, reference):
    d = healed
    prefill, decode = _nodes_of(d, cluster, "prefill"), _nodes_of(d, cluster, "decode")
    assert len({ns[0] for ns in prefill.values()}) == 1 and set(prefill["prefill-0"]) <= {"a", "b", "c"}, prefill
    assert decode == {"decode-0": ["e"]}
    out = asyncio.run(_stream(d.address, LONG_PROMPT, SHORT_TOKENS))
    assert out == reference[(len(LONG_PROMPT), SHORT_TOKENS)]
    assert d.router.stats()["policy"]["disagg_routes"] >= 1


@pytest.mark.parametrize("healed", ["pd"], indirect=True)
def test_prefill_node_loss_loses_no_request(healed, cluster, reference):
    d = healed
    node = _nodes_of(d, cluster, "prefill")["prefill-0"][0]  # PACK: both prefill workers are there

    members = dict(d.controller.members())
    decode, prefills = members["decode-0"], [members["prefill-0"], members["prefill-1"]]
    failures = _stats(d).get("prefill_failures", 0)

    async def run() -> list[list[int]]:
        # 8 long prompts queue on the two prefill workers, PD_CHUNK tokens a step: seconds of prefill
        # work, so most of it is still to run when the node goes however quickly the first one starts
        tasks = [asyncio.ensure_future(_stream(d.address, LONG_PROMPT, SHORT_TOKENS)) for _ in range(8)]
        await asyncio.to_thread(_wait, lambda: any(r.num_running + r.num_waiting for r in map(_load, prefills)),
                                60, "a request in prefill")
        await asyncio.to_thread(cluster.remove, node)
        more = [asyncio.ensure_future(_stream(d.address, LONG_PROMPT, SHORT_TOKENS)) for _ in range(2)]
        return await asyncio.gather(*tasks, *more)

    outs = asyncio.run(run())
    assert outs == [reference[(len(LONG_PROMPT), SHORT_TOKENS)]] * 10
    assert _stats(d).get("prefill_failures", 0) > failures  # some were in prefill when the node went
    # the decode worker holds nothing for the dead prefill peer
    _wait(lambda: _idle(_load(decode)), 30, "decode-0 to free its reservations")
    _wait(lambda: len(d.controller.members()) == 3, 120, "the prefill pool re-created on another node")
    assert {ns[0] for ns in _nodes_of(d, cluster, "prefill").values()} <= {"a", "b", "c"} - {node}


# -------------------------------------------------------------------------------------- tp: a gang
@pytest.mark.parametrize("healed", ["tp"], indirect=True)
def test_gang_rank_node_loss_fails_retryably_or_resumes_and_the_gang_reforms(healed, cluster, reference):
    d = healed
    ranks = _nodes_of(d, cluster, "main")["main-0"]
    assert len(set(ranks)) == 2 and set(ranks) <= {"a", "b", "c"}, ranks  # SPREAD: one rank per node
    try:
        tokens, _, _ = asyncio.run(_remove_mid_stream(d, cluster, lambda w: ranks[1]))
    except DuetError as e:  # failed with a status the client may retry
        assert e.code == grpc.StatusCode.UNAVAILABLE, e
    else:  # or resumed once the gang re-formed
        assert tokens == reference[(len(PROMPT), STREAM_TOKENS)]
    _wait(lambda: len(d.controller.members()) == 1, 120, "the gang re-formed")
    assert ranks[1] not in _nodes_of(d, cluster, "main")["main-0"]
    assert asyncio.run(_stream(d.address, PROMPT, SHORT_TOKENS)) == reference[(len(PROMPT), SHORT_TOKENS)]
