"""Runtime LoRA adapters shared by every router through the controller (router/shared_adapters.py,
cluster/deploy/membership_service.py): two routers follow one membership service in front of fake
workers that speak the LoRA contract (tests/testkit/router_fakes.py). An adapter loaded through
router A is served through router B, and by a router started afterwards; an unload through B stops
it on A; a name shared with another source is refused; the controller's kept list (its store)
survives the controller, and a list older than the one applied is skipped."""

from __future__ import annotations


import grpc
import pytest
from testkit.router_fakes import FakeWorker, FakeWorkerServer, LoopThread, SCRIPT, router_config, run_async, \
    wait_until

from cluster.deploy.membership_service import MembershipServicer, serve_membership
from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from router.adapters import AdapterRegistry
from router.client import DuetError, generate_text
from router.config import ModelSpec
from router.server import serve_router
from router.shared_adapters import SharedAdapters
from testkit.static_controller import StaticController

SMOL = "SmolLM2-135M-Instruct"


class DictStore:
    def __init__(self) -> None:
        self.payload: dict | None = None

    def save(self, payload: dict) -> bool:
        self.payload = payload
        return True

    def load(self) -> dict | None:
        return self.payload


@pytest.fixture(scope="module")
def deployment(smollm2_path, tok):
    lt = LoopThread()
    ids = tok.encode(SCRIPT, add_special_tokens=False)
    workers = {wid: FakeWorkerServer(lt, FakeWorker(wid, ids, tok.eos_token_id)) for wid in ("w0", "w1")}
    for s in workers.values():
        s.start()
        s.worker.lora = True
    store = DictStore()
    service = serve_membership(StaticController([(w, s.endpoint) for w, s in workers.items()]), "127.0.0.1", 0,
                               adapters_store=store)
    try:
        yield workers, service, store
    finally:
        service.stop()
        for s in workers.values():
            s.stop_sync()
        lt.close()


def _router(smollm2_path, tok, service):
    return serve_router(router_config(smollm2_path, membership_address=service.address, membership_wait_s=10.0),
                        [], tokenizer=tok)


def _admin(router, method: str, request):
    async def call():
        async with grpc.aio.insecure_channel(router.address) as channel:
            return await getattr(control_pb2_grpc.RouterAdminStub(channel), method)(request, timeout=10)
    return run_async(call())


def _names(router) -> list[str]:
    return [a.name for a in _admin(router, "ListAdapters", control_pb2.ListAdaptersRequest()).adapters]


def _gen(router, model: str) -> str:
    return generate_text("Hi", target=router.address, model=model, max_tokens=3, temperature=0, timeout=10, retries=0)


def test_an_adapter_loaded_through_one_router_is_served_through_every_router(smollm2_path, tok, deployment):
    workers, service, store = deployment
    with _router(smollm2_path, tok, service) as a, _router(smollm2_path, tok, service) as b:
        wait_until(lambda: all(len(r.stats()["workers"]) == 2 for r in (a, b)), what="both routers see the workers")
        status = _admin(a, "LoadAdapter", control_pb2.LoadAdapterRequest(name="chat", source="/adapters/chat",
                                                                          preload=True))
        assert (status.name, status.base_model, status.origin) == ("chat", SMOL, "runtime")
        assert _names(a) == ["chat"]  # shared before the call returned
        wait_until(lambda: _names(b) == ["chat"], what="router B to learn the adapter from the controller")
        assert _gen(b, "chat")
        sent = [req for s in workers.values() for req in s.worker.submitted]
        assert [(r.adapter.name, r.adapter.source) for r in sent] == [("chat", "/adapters/chat")]
        assert store.payload["adapters"] == [{"name": "chat", "source": "/adapters/chat", "base_model": SMOL,
                                              "pinned": False}]

        # the same name with another source, through the other router: refused, nothing changes
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _admin(b, "LoadAdapter", control_pb2.LoadAdapterRequest(name="chat", source="/other"))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS

        # a router started later (or restarted) serves it from its first member list
        with _router(smollm2_path, tok, service) as c:
            assert _names(c) == ["chat"]
            assert _gen(c, f"{SMOL}:chat")

            # unloaded through B: A and C stop routing it too
            _admin(b, "UnloadAdapter", control_pb2.UnloadAdapterRequest(name="chat"))
            for r in (a, c):
                wait_until(lambda r=r: _names(r) == [], what="the unload to reach every router")
                with pytest.raises(DuetError) as e2:
                    _gen(r, "chat")
                assert e2.value.code == grpc.StatusCode.NOT_FOUND
            assert store.payload["adapters"] == []
        for s in workers.values():
            s.worker.reset()
            s.worker.lora = True


def test_a_refused_share_registers_nothing(smollm2_path, tok, deployment):
    """Shared directly at the controller with another source first: the router's load is refused
    ALREADY_EXISTS by the controller after its preload, and it does not keep the adapter."""
    workers, service, _ = deployment
    with _router(smollm2_path, tok, service) as a:
        run_async(_put(service.address, control_pb2.SharedAdapter(name="poet", source="/x", base_model="other")))
        wait_until(lambda: a.server.shared_adapters.revision >= 1, what="the list")
        assert _names(a) == []  # its base model is not served here: skipped
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _admin(a, "LoadAdapter", control_pb2.LoadAdapterRequest(name="poet", source="/adapters/poet"))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already shared" in e.value.details()
        assert _names(a) == []
        run_async(_delete(service.address, "poet"))


async def _put(address: str, adapter: control_pb2.SharedAdapter) -> control_pb2.SharedAdapters:
    async with grpc.aio.insecure_channel(address) as channel:
        return await control_pb2_grpc.MembershipStub(channel).PutAdapter(adapter, timeout=10)


async def _delete(address: str, name: str) -> control_pb2.SharedAdapters:
    async with grpc.aio.insecure_channel(address) as channel:
        return await control_pb2_grpc.MembershipStub(channel).DeleteAdapter(
            control_pb2.DeleteAdapterRequest(name=name), timeout=10)


def test_the_controllers_list_survives_it_and_stale_lists_are_skipped():
    store = DictStore()
    first = MembershipServicer(adapters_store=store)
    first.publish([("w0", "127.0.0.1:1")])

    class Ctx:
        def abort(self, code, details):
            raise AssertionError(f"{code}: {details}")

    first.PutAdapter(control_pb2.SharedAdapter(name="sql", source="/a/sql", base_model=SMOL), Ctx())
    first.PutAdapter(control_pb2.SharedAdapter(name="sql", source="/a/sql", base_model=SMOL), Ctx())  # idempotent
    reply = first.PutAdapter(control_pb2.SharedAdapter(name="chat", source="/a/chat", base_model=SMOL), Ctx())
    assert reply.revision == 2 and [a.name for a in reply.adapters] == ["chat", "sql"]
    assert [a.name for a in first._message.adapters.adapters] == ["chat", "sql"]  # every watcher gets it
    second = MembershipServicer(adapters_store=store)  # a restarted controller
    second.publish([("w0", "127.0.0.1:1")])
    assert second._message.adapters == reply

    registry = AdapterRegistry([ModelSpec(SMOL, "/ckpt")])
    shared = SharedAdapters("unused:0", registry)
    shared.apply(reply, fresh=True)
    older = control_pb2.SharedAdapters(revision=1, adapters=reply.adapters[1:])
    shared.apply(older, fresh=False)  # pushed before the newer reply, arriving after it: skipped
    assert [a.name for a in registry.adapters()] == ["chat", "sql"] and shared.num_stale == 1
    shared.apply(control_pb2.SharedAdapters(revision=0), fresh=True)  # a new deployment's controller
    assert registry.adapters() == []
