"""Membership over gRPC (the controller's duet.control.v1.Membership service, cluster/deploy/membership_service.py,
followed by router/membership.py) and the router's RouterAdmin stats, against in-process fake workers."""

from __future__ import annotations

import socket
from collections.abc import Callable

import grpc
import pytest
from testkit.router_fakes import members, wait_until

from cluster.deploy.membership_service import MembershipError, MembershipServicer, serve_membership
from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from protos.duet.v1 import duet_pb2, duet_pb2_grpc
from router.config import RouterConfig, RouterConfigError
from router.server import serve_router


class FakeController:
    """What serve_membership needs of cluster.deploy.controller.Controller: subscribe(push), role_of(id),
    drafter_pool_of(id), model_of(id) (workers whose id starts with "t" serve the model "tiny")."""

    def __init__(self, initial: list[tuple[str, str]]) -> None:
        self.members = list(initial)
        self.pushes: list[Callable[[list[tuple[str, str]]], None]] = []

    def role_of(self, worker_id: str) -> str:
        return "prefill" if worker_id.startswith("p") else "colocated"

    def drafter_pool_of(self, worker_id: str) -> str:
        return ""

    def model_of(self, worker_id: str) -> str:
        return "tiny" if worker_id.startswith("t") else ""

    def subscribe(self, push: Callable[[list[tuple[str, str]]], None], *, detailed: bool = False) -> None:
        self.pushes.append(push)
        push(self.members)

    def change(self, new: list[tuple[str, str]]) -> None:
        self.members = list(new)
        for push in self.pushes:
            push(self.members)


def _config(path, membership: str, **kw) -> RouterConfig:
    return RouterConfig(tokenizer_path=str(path), port=0, http_port=0, max_model_len=512, policy="round_robin",
                        load_poll_interval_s=0.05, load_poll_timeout_s=0.5, membership_address=membership,
                        membership_wait_s=5.0, **kw)


def _worker_ids(router) -> list[str]:
    return sorted(w["worker_id"] for w in router.stats()["workers"])


def _router_stats(address: str) -> control_pb2.RouterStats:
    with grpc.insecure_channel(address) as channel:
        return control_pb2_grpc.RouterAdminStub(channel).GetRouterStats(control_pb2.GetRouterStatsRequest(), timeout=5)


def test_router_follows_the_controller_and_survives_its_restart(smollm2_path, tok, pool):
    controller = FakeController(members(pool))
    service = serve_membership(controller, "127.0.0.1", 0)
    port = service.port
    router = serve_router(_config(smollm2_path, service.address), [], tokenizer=tok)
    try:
        # start waited for the first list: both workers known before the router said it was up
        assert _worker_ids(router) == ["w0", "w1"] and router.stats()["membership_version"] == 1
        controller.change(members(pool[:1]))  # w1 leaves
        wait_until(lambda: _worker_ids(router) == ["w0"], what="w1 gone")
        assert router.stats()["membership_version"] == 2
        with grpc.insecure_channel(router.address) as channel:
            stub = duet_pb2_grpc.DuetStub(channel)
            for s in pool:
                s.worker.reset()
            for _ in range(3):
                list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=duet_pb2.SamplingParams(max_tokens=2)),
                                   timeout=10))
        assert [len(s.worker.submitted) for s in pool] == [3, 0]

        service.stop()  # the controller goes away: the router keeps routing over its last list
        wait_until(lambda: not router.server.membership.connected, what="watch broken")
        assert _worker_ids(router) == ["w0"]
        controller2 = FakeController(members(pool))  # a new controller process: versions start again
        service = serve_membership(controller2, "127.0.0.1", port)
        wait_until(lambda: _worker_ids(router) == ["w0", "w1"], timeout=15, what="list from the new controller")
        assert router.server.membership.num_reconnects >= 1
    finally:
        router.stop(0)
        service.stop()


def test_router_admin_stats(smollm2_path, tok, pool):
    for s in pool:
        s.worker.reset()
    controller = FakeController(members(pool))
    service = serve_membership(controller, "127.0.0.1", 0)
    try:
        with serve_router(_config(smollm2_path, service.address), [], tokenizer=tok) as router:
            with grpc.insecure_channel(router.address) as channel:
                stub = duet_pb2_grpc.DuetStub(channel)
                list(stub.Generate(duet_pb2.GenerateRequest(prompt="x", sampling=duet_pb2.SamplingParams(max_tokens=2)),
                                   timeout=10))
                with pytest.raises(grpc.RpcError):
                    list(stub.Generate(duet_pb2.GenerateRequest(prompt=""), timeout=10))
            st = _router_stats(router.address)
            assert (st.policy, st.requests, st.in_flight, st.queued, st.max_in_flight) == ("round_robin", 2, 0, 0, 128)
            assert st.counters["finish_length"] == 1 and st.counters["error_invalid_argument"] == 1
            assert st.membership_version == 1 and sorted(w.worker_id for w in st.workers) == ["w0", "w1"]
            assert all(w.healthy and w.endpoint for w in st.workers)
    finally:
        service.stop()


def test_servicer_versions_only_real_changes():
    s = MembershipServicer()
    s.publish([("a", "h:1")])
    s.publish([("a", "h:1")])  # the controller re-pushes an unchanged list: not a new version
    s.publish([])
    s.publish([("a", "h:2")])  # a restart's new endpoint is a change
    assert s._message.version == 3 and [(m.worker_id, m.endpoint) for m in s._message.members] == [("a", "h:2")]


def test_busy_controller_port_and_bad_address_are_clear_errors(smollm2_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(MembershipError, match=f"controller.port={port}: cannot listen"):
            serve_membership(FakeController([]), "127.0.0.1", port)
    with pytest.raises(RouterConfigError, match="^membership_address='controller'"):
        RouterConfig(tokenizer_path=str(smollm2_path), membership_address="controller")


def test_draining_member_gets_no_new_requests_and_its_stream_finishes(smollm2_path, tok, pool):
    """A member the controller lists as draining (the autoscaler is removing it) keeps the stream it
    has -- the request completes -- but gets no new request; then it leaves. Along the way the router
    exports per-pool request histograms and the workers' load, labelled with the members' pools."""
    import threading

    from router.prometheus import metrics_registry
    from prometheus_client import generate_latest

    for s in pool:
        s.worker.reset()
    details = [(w, e, "decode", "dec", False) for w, e in members(pool)]
    controller = FakeController(details)
    service = serve_membership(controller, "127.0.0.1", 0)
    try:
        with serve_router(_config(smollm2_path, service.address), [], tokenizer=tok) as router:
            pool[1].worker.delay_s = 0.05  # w1's stream lasts ~0.5 s
            with grpc.insecure_channel(router.address) as channel:
                stub = duet_pb2_grpc.DuetStub(channel)
                request = duet_pb2.GenerateRequest(prompt="x", sampling=duet_pb2.SamplingParams(max_tokens=8))
                list(stub.Generate(request, timeout=10))  # round robin: w0
                slow: list = []
                t = threading.Thread(target=lambda: slow.extend(stub.Generate(request, timeout=20)))
                t.start()  # w1, streaming slowly
                wait_until(lambda: pool[1].worker.active == 1, what="w1 streaming")
                controller.change([details[0], (*details[1][:4], True)])  # w1 drains
                wait_until(lambda: any(w["draining"] for w in router.stats()["workers"]), what="w1 draining")
                for _ in range(4):
                    list(stub.Generate(request, timeout=10))
                t.join(20)
            assert slow and slow[-1].finish_reason == duet_pb2.FINISH_REASON_LENGTH  # the drained stream completed
            assert [len(s.worker.submitted) for s in pool] == [5, 1]
            text = generate_latest(metrics_registry(router.stats, router.server.metrics.registry)).decode()
            for line in ('duet_requests_arrived_total{pool="dec"} 6.0', 'duet_time_to_first_token_seconds_count{pool="dec"} 6.0',
                         'duet_time_per_output_token_seconds_count{pool="dec"} 6.0',
                         'duet_request_output_tokens_sum{pool="dec"} 48.0',
                         'duet_worker_kv_blocks_total{pool="dec",worker_id="w0"} 1024.0',
                         'duet_requests_finished_total{finish_reason="length",pool="dec"} 6.0'):
                assert line in text, f"{line!r} missing from:\n{text}"
            controller.change([details[0]])  # drained: it leaves
            wait_until(lambda: _worker_ids(router) == ["w0"], what="w1 gone")
    finally:
        service.stop()


def test_drafter_replicas_and_a_targets_drafter_pool_travel_with_the_list():
    """Drafter replicas are members (role drafter); a target carries the drafter pool it drafts on."""
    servicer = MembershipServicer(lambda w: "colocated", lambda w: "drafters" if w.startswith("decode") else "")
    servicer.publish([("decode-0", "h:1", "decode", "decode", False), ("drafters-0", "h:2", "drafter", "drafters", False)])
    assert [(m.worker_id, m.role, m.pool, m.drafter_pool) for m in servicer._message.members] == [
        ("decode-0", "decode", "decode", "drafters"), ("drafters-0", "drafter", "drafters", "")]


def test_each_members_model_travels_with_the_list_and_routes_its_requests(smollm2_path, tok, pool):
    """The controller tells routers which model each worker serves (Member.model, "" = the default);
    the router sends a model's requests to its workers only."""
    from router.client import generate_text
    from router.config import ModelSpec

    for s in pool:
        s.worker.reset()
    controller = FakeController([("t0", pool[0].endpoint), ("w1", pool[1].endpoint)])  # t0 serves "tiny"
    service = serve_membership(controller, "127.0.0.1", 0)
    assert [(m.worker_id, m.model) for m in service.servicer._message.members] == [("t0", "tiny"), ("w1", "")]
    router = serve_router(_config(smollm2_path, service.address, models=(ModelSpec("tiny", str(smollm2_path)),)), [],
                          tokenizer=tok)
    try:
        assert {w["worker_id"]: w["model"] for w in router.server.directory.describe()} == {"t0": "tiny", "w1": ""}
        wait_until(lambda: router.server.serving(), what="healthy workers")
        for model in ("tiny", "", "tiny", "SmolLM2-135M-Instruct"):
            assert generate_text("Hi", target=router.address, model=model, max_tokens=2, timeout=10)
        assert (len(pool[0].worker.submitted), len(pool[1].worker.submitted)) == (2, 2)
        assert [w.model for w in _router_stats(router.address).workers] == ["tiny", ""]
    finally:
        router.stop()
        service.stop()
