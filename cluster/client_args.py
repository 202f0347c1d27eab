"""The client flags shared by the commands that talk to a router (``duet generate``, ``duet bench``):
TLS and the bearer token, parsed into what router/client.py takes."""

from __future__ import annotations

import argparse
import os


def add_client_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("router security (a router started with TLS or --auth-tokens-file)")
    g.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    g.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA (implies --tls)")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a router that requires one (mTLS)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-server-name", metavar="NAME", help="name to check the router's certificate against")
    g.add_argument("--token", default=os.environ.get("DUET_TOKEN"),
                   help="bearer token sent as 'authorization: Bearer <token>' (default $DUET_TOKEN)")


def client_security(args: argparse.Namespace):
    """(ClientTLS | None, token | None) from the flags of add_client_security."""
    from router.client import ClientTLS

    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return None, args.token
    return ClientTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name), args.token
