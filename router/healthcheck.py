"""A one-shot grpc.health.v1 check of a router, for probes that cannot speak TLS themselves.

Kubernetes' built-in gRPC probes connect in plaintext, so a router serving TLS (router.tls_*)
is probed with this command instead (the Helm chart does so when ``router.tls.secretName`` is set)::

    python -m router.healthcheck --target 127.0.0.1:50051 --tls-ca /etc/duet/tls/ca.crt \\
        --tls-server-name duet.example.com --service duet.control.v1.RouterAdmin

Exit code 0 if the service is SERVING, 1 otherwise (the status or the error on stderr); health
checks need no bearer token (router/security.py keeps them open).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.client import ClientTLS, open_channel


def check(target: str, service: str = "", *, tls: ClientTLS | None = None, timeout: float = 3.0) -> str:
    """The service's status name (SERVING, NOT_SERVING, ...), or the gRPC error code's name."""
    with open_channel(target, tls=tls, aio=False) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m router.healthcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="router host:port")
    p.add_argument("--service", default="", help="health service name ('' = overall readiness; "
                   "duet.control.v1.RouterAdmin = liveness)")
    p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS trusting this CA")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (a router requiring mTLS)")
    p.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-server-name", metavar="NAME", help="name to check the router's certificate against")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = p.parse_args(argv)
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name:
        try:
            tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        except ValueError as e:
            p.error(str(e))
    status = check(args.target, args.service, tls=tls, timeout=args.timeout)
    if status != "SERVING":
        print(f"{args.target} {args.service or '(overall)'}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
