"""TLS, mTLS, bearer tokens and request-size limits on the router's public endpoint
(router/security.py), with real certificates made by openssl and the sync and async clients.
Workers are the in-process fakes of tests/testkit/router_fakes.py; ``pki`` and ``pool`` are fixtures of
tests/router/conftest.py."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testkit.pki import ADMIN_TOKEN, DIGEST_TOKEN, GEN_TOKEN
from testkit.router_fakes import members, router_config, run_async

from protos.duet.control.v1 import control_pb2, control_pb2_grpc
from router.client import ClientTLS, DuetClient, DuetError, auth_metadata, generate_text, open_channel
from router.config import RouterConfigError
from router.security import TokenStore, required_scope
from router.server import serve_router

def _gen(target: str, **kw) -> str:
    return generate_text("Hi", target=target, max_tokens=4, temperature=0, timeout=10, **kw)


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(DuetError) as e:
        fn()
    return e.value.code


def test_tls_serves_trusting_clients_only(smollm2_path, tok, pool, pki):
    cfg = router_config(smollm2_path, tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"))
    with serve_router(cfg, members(pool[:1]), tokenizer=tok) as r:
        tls = ClientTLS(ca_file=str(pki / "ca.pem"))
        assert _gen(r.address, tls=tls)  # a completion over TLS
        assert run_async(_async_generate(r.address, tls)) == _gen(r.address, tls=tls)
        # plaintext against a TLS port, and a client that does not trust the router's CA, both fail
        # the handshake: UNAVAILABLE, no RPC ever runs
        assert _code(lambda: _gen(r.address)) == grpc.StatusCode.UNAVAILABLE
        assert _code(lambda: _gen(r.address, tls=ClientTLS(ca_file=str(pki / "other_ca.pem")))) == \
            grpc.StatusCode.UNAVAILABLE


async def _async_generate(target: str, tls: ClientTLS | None = None, token: str | None = None) -> str:
    async with DuetClient(target, tls=tls, token=token) as client:
        return (await client.complete("Hi", max_tokens=4, temperature=0, timeout=10)).text


def test_mtls_requires_a_client_certificate_from_the_ca(smollm2_path, tok, pool, pki):
    cfg = router_config(smollm2_path, tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                        tls_client_ca_file=str(pki / "ca.pem"))
    ca = str(pki / "ca.pem")
    with serve_router(cfg, members(pool[:1]), tokenizer=tok) as r:
        assert _gen(r.address, tls=ClientTLS(ca, str(pki / "client.pem"), str(pki / "client.key")))
        assert _code(lambda: _gen(r.address, tls=ClientTLS(ca))) == grpc.StatusCode.UNAVAILABLE
        stranger = ClientTLS(ca, str(pki / "stranger.pem"), str(pki / "stranger.key"))
        assert _code(lambda: _gen(r.address, tls=stranger)) == grpc.StatusCode.UNAVAILABLE


def _admin(target: str, token: str | None) -> control_pb2.RouterStats:
    with open_channel(target, aio=False) as ch:
        return control_pb2_grpc.RouterAdminStub(ch).GetRouterStats(control_pb2.GetRouterStatsRequest(), timeout=5,
                                                                   metadata=auth_metadata(token))


def test_bearer_tokens_and_scopes(smollm2_path, tok, pool, pki):
    cfg = router_config(smollm2_path, auth_tokens_file=str(pki / "tokens"))
    with serve_router(cfg, members(pool[:1]), tokenizer=tok) as r:
        a = r.address
        assert _gen(a, token=GEN_TOKEN) and _gen(a, token=DIGEST_TOKEN) and _gen(a, token=ADMIN_TOKEN)
        assert run_async(_async_generate(a, token=GEN_TOKEN))
        assert _code(lambda: _gen(a)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: _gen(a, token="not-a-token")) == grpc.StatusCode.UNAUTHENTICATED
        with open_channel(a, aio=False) as ch:  # a scheme other than Bearer
            with pytest.raises(grpc.RpcError) as e:
                from protos.duet.v1 import duet_pb2, duet_pb2_grpc

                list(duet_pb2_grpc.DuetStub(ch).Generate(duet_pb2.GenerateRequest(prompt="Hi"), timeout=5,
                                                         metadata=(("authorization", f"Basic {GEN_TOKEN}"),)))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in e.value.details()
            # health stays open for probes and load balancers
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        # RouterAdmin needs the admin scope: PERMISSION_DENIED for a generate-only token
        with pytest.raises(grpc.RpcError) as e:
            _admin(a, GEN_TOKEN)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "admin" in e.value.details()
        stats = _admin(a, ADMIN_TOKEN)
        counters = dict(stats.counters)
        assert counters["auth_unauthenticated"] == 3 and counters["auth_permission_denied"] == 1


def test_request_size_limit_is_a_clean_status_and_the_router_keeps_serving(smollm2_path, tok, pool):
    with serve_router(router_config(smollm2_path, max_request_bytes=16 << 10), members(pool[:1]), tokenizer=tok) as r:
        assert _code(lambda: generate_text("x" * (64 << 10), target=r.address, timeout=10)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _gen(r.address)


def test_bad_security_settings_name_the_setting(smollm2_path, tok, pki, tmp_path):
    with pytest.raises(RouterConfigError, match="tls_key_file"):
        router_config(smollm2_path, tls_cert_file=str(pki / "server.pem"))
    with pytest.raises(RouterConfigError, match="tls_client_ca_file"):
        router_config(smollm2_path, tls_client_ca_file=str(pki / "ca.pem"))
    with pytest.raises(RouterConfigError, match="max_request_bytes"):
        router_config(smollm2_path, max_request_bytes=10)
    missing = router_config(smollm2_path, tls_cert_file=str(tmp_path / "nope.pem"), tls_key_file=str(pki / "server.key"))
    with pytest.raises(RouterConfigError, match="tls_cert_file=.*nope.pem.*cannot read"):
        serve_router(missing, [], tokenizer=tok)
    swapped = router_config(smollm2_path, tls_cert_file=str(pki / "server.key"), tls_key_file=str(pki / "server.pem"))
    with pytest.raises(RouterConfigError, match="not a PEM certificate"):
        serve_router(swapped, [], tokenizer=tok)
    for text, match in (("tok generate,root\n", "line 1: unknown scope"), ("# only comments\n\n", "holds no token"),
                        ("a b c\n", "line 1: expected 'TOKEN")):
        f = tmp_path / "tokens"
        f.write_text(text)
        with pytest.raises(RouterConfigError, match=match):
            serve_router(router_config(smollm2_path, auth_tokens_file=str(f)), [], tokenizer=tok)


def test_token_store_keeps_digests_only_and_scopes_by_method(pki):
    store = TokenStore.load(str(pki / "tokens"))
    assert store.scopes(GEN_TOKEN) == {"generate"} and store.scopes(ADMIN_TOKEN) == {"generate", "admin"}
    assert store.scopes(DIGEST_TOKEN) == {"generate"} and store.scopes("nope") is None
    assert not any(t in repr(store) for t in (GEN_TOKEN, ADMIN_TOKEN, DIGEST_TOKEN))
    assert required_scope("/grpc.health.v1.Health/Check") is None
    assert required_scope("/duet.v1.Duet/Generate") == "generate"
    assert required_scope("/duet.control.v1.RouterAdmin/GetRouterStats") == "admin"
    assert required_scope("/some.future.Service/Method") == "admin"  # closed by default


def test_cluster_config_carries_security_to_the_router_and_names_bad_keys(pki, tmp_path):
    from cluster.config.duet import ClusterConfigError, load_config

    env = {"DUET_TLS_CERT_FILE": str(pki / "server.pem"), "DUET_TLS_KEY_FILE": str(pki / "server.key"),
           "DUET_AUTH_TOKENS_FILE": str(pki / "tokens")}
    cfg = load_config(env=env, overrides={"router.tls_client_ca_file": str(pki / "ca.pem"),
                                          "router.max_request_bytes": "64KiB"})
    r = cfg.to_router_config(tokenizer_path=str(tmp_path))
    assert (r.tls_cert_file, r.tls_key_file, r.tls_client_ca_file, r.auth_tokens_file) == (
        str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"), str(pki / "tokens"))
    assert r.max_request_bytes == 64 << 10 and r.tls
    with pytest.raises(ClusterConfigError, match=r"router.tls_key_file=None .*set both or neither"):
        load_config(env={"DUET_TLS_CERT_FILE": str(pki / "server.pem")})
    with pytest.raises(ClusterConfigError, match=r"router.auth_tokens_file=.*\(from env DUET_AUTH_TOKENS_FILE\).*readable"):
        load_config(env={"DUET_AUTH_TOKENS_FILE": str(tmp_path / "missing")})


def test_duet_cli_generate_and_status_with_tls_and_token(smollm2_path, tok, pool, pki):
    import os
    import sys

    cfg = router_config(smollm2_path, tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"),
                        auth_tokens_file=str(pki / "tokens"))
    duet = [sys.executable, "-m", "cluster.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("DUET_TOKEN", "DUET_TARGET", "RAY_ADDRESS")}
    with serve_router(cfg, members(pool[:1]), tokenizer=tok) as r:
        base = [*duet, "generate", "Hi", "--target", r.address, "--max-tokens", "4", "--tls-ca", str(pki / "ca.pem")]
        ok = subprocess.run([*base, "--token", GEN_TOKEN], capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0 and "[4 tokens" in ok.stderr, ok.stderr
        denied = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
        assert denied.returncode != 0 and "UNAUTHENTICATED" in denied.stderr and "Traceback" not in denied.stderr
        # what `duet status` shows of the router, with the same client settings
        from cluster.cli import build_parser
        from cluster.client_args import client_security
        from cluster.deploy.status import router_status

        args = build_parser().parse_args(["status", "--target", r.address, "--tls-ca", str(pki / "ca.pem"),
                                          "--token", ADMIN_TOKEN])
        tls, token = client_security(args)
        router = router_status(r.address, 5.0, tls=tls, token=token)
        assert router["health"] == "SERVING" and "error" not in router and router["stats"]["requests"] >= 1
        denied = router_status(r.address, 5.0, tls=tls, token=GEN_TOKEN)
        assert denied["error"].startswith("PERMISSION_DENIED")
