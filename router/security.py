"""Transport security and authentication for the router's public endpoints (gRPC, and the
OpenAI-compatible HTTP API of router/http_api/, which applies the same TLS files and tokens:
``Authorization: Bearer <token>``; the /v1 paths need ``generate``, /metrics and the adapter admin
paths (/v1/load_lora_adapter, /v1/unload_lora_adapter, /v1/lora_adapters) ``admin``, /health is
open; 401 and 403 stand for UNAUTHENTICATED and PERMISSION_DENIED).

Three independent switches (all off by default, for a router on localhost):

TLS       ``tls_cert_file`` + ``tls_key_file`` (PEM): the router listens with TLS only.
mTLS      ``tls_client_ca_file`` (PEM) as well: a client must present a certificate signed by that
          CA or the TLS handshake fails (the client sees UNAVAILABLE before any RPC runs).
Tokens    ``auth_tokens_file``: every RPC except health checks must carry the metadata
          ``authorization: Bearer <token>`` with a token listed in the file:
              missing header, not "Bearer ...", or unknown token -> UNAUTHENTICATED
              known token without the scope the method needs     -> PERMISSION_DENIED

Token file format (one token per line; '#' starts a comment; scopes default to ``generate``)::

    # token                             scopes
    s3cr3t-team-a                       generate
    sha256:9f86d081884c7d65...          generate,admin     # a token given by its SHA-256 hex digest

Scopes: ``generate`` covers duet.v1.Duet (Generate, ListModels) and server reflection;
``admin`` covers duet.control.v1.RouterAdmin (what ``duet status`` reads, and the LoRA adapter
admin calls LoadAdapter / UnloadAdapter / ListAdapters). grpc.health.v1 is always
open: load balancers and Kubernetes probes call it without credentials. The router keeps only the
tokens' SHA-256 digests in memory, so a heap dump or a log line never shows a token.

Request size: ``max_request_bytes`` bounds one request message (gRPC's own receive limit; a larger
message ends with RESOURCE_EXHAUSTED before the router parses it).

Workers' internal endpoints are not behind this: they bind to the node's cluster address and the
router never forwards a client's call to them (it only sends Submit/Abort/GetLoad it built itself).
Nothing client-supplied is ever unpickled or imported: requests are protobuf messages only.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

logger = logging.getLogger(__name__)

SCOPES = ("generate", "admin")
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_SCOPE_BY_PREFIX = (
    ("/duet.control.v1.RouterAdmin/", "admin"),
    ("/duet.v1.Duet/", "generate"),
    ("/grpc.reflection.", "generate"),
)
_DIGEST_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


class SecurityConfigError(ValueError):
    """A TLS or token setting is unusable; the message names the setting and the fix."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{what}={path!r}: cannot read it ({e.strerror or e})") from None
    if not data.strip():
        raise SecurityConfigError(f"{what}={path!r}: the file is empty")
    return data


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS (and, with ``client_ca_file``, mTLS: client certificates required) from PEM files."""
    cert, key = _read(cert_file, "tls_cert_file"), _read(key_file, "tls_key_file")
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise SecurityConfigError(f"tls_cert_file={cert_file!r}: not a PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise SecurityConfigError(f"tls_key_file={key_file!r}: not a PEM private key")
    if client_ca_file is None:
        return grpc.ssl_server_credentials([(key, cert)])
    ca = _read(client_ca_file, "tls_client_ca_file")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenStore:
    """SHA-256 digest of each accepted token -> its scopes."""

    scopes_by_digest: dict[str, frozenset[str]]

    @classmethod
    def load(cls, path: str) -> TokenStore:
        text = _read(path, "auth_tokens_file").decode("utf-8", errors="strict")
        entries: dict[str, frozenset[str]] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise SecurityConfigError(f"auth_tokens_file={path!r} line {n}: expected 'TOKEN [SCOPES]' "
                                          "(scopes comma-separated, no spaces)")
            token, scopes = parts[0], frozenset((parts[1] if len(parts) == 2 else "generate").split(","))
            bad = sorted(scopes - set(SCOPES))
            if bad:
                raise SecurityConfigError(f"auth_tokens_file={path!r} line {n}: unknown scope(s) {bad}; "
                                          f"use {', '.join(SCOPES)}")
            m = _DIGEST_RE.match(token)
            entries[m.group(1).lower() if m else _digest(token)] = scopes
        if not entries:
            raise SecurityConfigError(f"auth_tokens_file={path!r}: holds no token (every line is blank or a comment)")
        return cls(entries)

    def scopes(self, token: str) -> frozenset[str] | None:
        return self.scopes_by_digest.get(_digest(token))


def required_scope(method: str) -> str | None:
    """The scope a full method name ("/pkg.Service/Method") needs; None = open to everyone."""
    if method.startswith(_OPEN_PREFIXES):
        return None
    for prefix, scope in _SCOPE_BY_PREFIX:
        if method.startswith(prefix):
            return scope
    return "admin"  # a service added later is closed until someone decides otherwise


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` before any handler runs (see the module doc)."""

    def __init__(self, store: TokenStore) -> None:
        self.store = store
        self.rejected = {"unauthenticated": 0, "permission_denied": 0}

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        scope = required_scope(details.method)
        if scope is None:
            return await continuation(details)
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        denied = self.check(header, scope, details.method)
        if denied is not None:
            return await self._deny(continuation, details, *denied)
        return await continuation(details)

    def check(self, header: str | bytes | None, scope: str, what: str) -> tuple[grpc.StatusCode, str] | None:
        """None if the ``authorization`` value ``header`` carries a token with ``scope``; else the
        status (UNAUTHENTICATED or PERMISSION_DENIED) and message, counted in ``rejected``. The
        gRPC interceptor and the HTTP API (router/http/) both decide here. what: the method or
        path, for the message."""
        if header is None:
            return self._count(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' header")
        scheme, _, token = (header if isinstance(header, str) else header.decode(errors="replace")).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return self._count(grpc.StatusCode.UNAUTHENTICATED, "the authorization header must be 'Bearer <token>'")
        scopes = self.store.scopes(token.strip())
        if scopes is None:
            return self._count(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        if scope not in scopes:
            return self._count(grpc.StatusCode.PERMISSION_DENIED, f"this token lacks the '{scope}' scope that {what} needs")
        return None

    def _count(self, code: grpc.StatusCode, message: str) -> tuple[grpc.StatusCode, str]:
        self.rejected[code.name.lower()] += 1
        return code, message

    async def _deny(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                    details: grpc.HandlerCallDetails, code: grpc.StatusCode, message: str) -> Any:
        logger.info("rejected %s: %s %s", details.method, code.name, message)
        handler = await continuation(details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return None

        async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        kind = ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream
                else "stream_unary" if handler.stream_unary else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(abort, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
