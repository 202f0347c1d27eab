"""router/healthcheck.py (the probe command for a router serving TLS) against a real TLS router
with openssl-made certificates (the ``pki`` fixture of tests/router/conftest.py)."""

from __future__ import annotations

from testkit.router_fakes import router_config

from router.client import ClientTLS
from router.healthcheck import check, main
from router.server import serve_router


def test_probe_over_tls_liveness_and_readiness(smollm2_path, tok, pki, capsys):
    cfg = router_config(smollm2_path, tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key"))
    with serve_router(cfg, [], tokenizer=tok) as r:  # no workers: alive, not ready
        tls = ["--tls-ca", str(pki / "ca.pem"), "--tls-server-name", "localhost"]
        assert main(["--target", r.address, "--service", "duet.control.v1.RouterAdmin", *tls]) == 0
        assert main(["--target", r.address, *tls]) == 1
        assert "(overall): NOT_SERVING" in capsys.readouterr().err
        # what a kubelet gRPC probe would do: plaintext against the TLS port fails the handshake
        assert check(r.address, "duet.control.v1.RouterAdmin") == "UNAVAILABLE"
        assert check(r.address, "duet.control.v1.RouterAdmin", tls=ClientTLS(str(pki / "other_ca.pem"))) == "UNAVAILABLE"
