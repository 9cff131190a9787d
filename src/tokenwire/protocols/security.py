"""`--auth-token` and `--tls-cert/--tls-key`: one token and one certificate for every listener.

Each protocol checks the token in its own idiom (gRPC metadata `authorization: Bearer`, an HTTP
`Authorization: Bearer` header, LMTP's WebSocket handshake header or `?token=`) through
`token_matches`, a constant-time comparison, and refuses in its own form (UNAUTHENTICATED,
HTTP 401 with the protocol's error body) before any work is done; each refusal is logged.
Health and readiness probes stay open (docs/limits.md lists them): an orchestrator's probe
carries no secret, and they answer nothing about prompts or outputs.

This module is also a server plugin (plugins.SERVER_PLUGINS): its flags, and a `bind` that
reads the certificate and key before the model loads, so a bad path is a one-line error.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import ssl
from collections.abc import Awaitable, Callable, Container, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("tokenwire.auth")
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token: send `Authorization: Bearer <token>`"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security (every protocol)")
    g.add_argument(
        "--auth-token",
        help="require this bearer token on every protocol: gRPC metadata / HTTP header "
        "`authorization: Bearer TOKEN`, LMTP also `?token=` (env $TOKENWIRE_AUTH_TOKEN)",
    )
    g.add_argument("--tls-cert", help="PEM certificate chain: serve every listener over TLS (with --tls-key)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")


async def bind(args: argparse.Namespace) -> None:
    """Nothing to listen on: checks the TLS files now, before any port or the model."""
    ssl_context(args)
    return None


def auth_token(args: argparse.Namespace) -> str | None:
    return getattr(args, "auth_token", None) or None


def tls_files(args: argparse.Namespace) -> tuple[str, str] | None:
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if not cert and not key:
        return None
    if not (cert and key):
        raise ValueError("--tls-cert and --tls-key must be given together")
    return cert, key


def ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """A server-side TLS context from --tls-cert/--tls-key, or None for plaintext."""
    files = tls_files(args)
    if files is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(*files)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-cert {files[0]} / --tls-key {files[1]}: {exc}") from None
    return context


def token_matches(expected: str, presented: str | bytes | None) -> bool:
    """Constant-time: how long the comparison takes tells nothing about the token."""
    if presented is None:
        return False
    given = presented.encode("utf-8", "surrogateescape") if isinstance(presented, str) else presented
    return hmac.compare_digest(given, expected.encode())


def owner_of(key: str | bytes | None) -> str:
    """The owner of what a request stores (a response, a session): a digest of the API key it
    presented ("" for none), so no key is kept in memory or on disk."""
    if key is None:
        return ""
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


def http_owner(headers: Mapping[str, str]) -> str:
    """owner_of the key an HTTP request presents: `Authorization: Bearer KEY` or `x-api-key`."""
    key = bearer(headers.get("authorization"))
    if key is None and "x-api-key" in headers:
        key = headers["x-api-key"].strip()
    return owner_of(key)


def bearer(header: str | bytes | None) -> str | bytes | None:
    """The token of an `Authorization: Bearer TOKEN` value, else None: the one rule of every
    protocol (HTTP, gRPC metadata, LMTP's handshake). The scheme is case-insensitive (RFC 9110
    section 11.1: `bearer`, `BEARER` are `Bearer`); the token is compared as sent."""
    if not header:
        return None
    sep = b" " if isinstance(header, bytes) else " "
    scheme, _, token = header.strip().partition(sep)  # type: ignore[arg-type]
    return token.strip() if scheme.lower() in ("bearer", b"bearer") else None


def refused(protocol: str, peer: str | None, what: str, presented: object) -> None:
    """The log line of every refusal (never the token itself)."""
    log.warning(
        "%s: refused %s from %s: %s token",
        protocol,
        what,
        peer or "?",
        "no" if presented is None else "wrong",
    )


Deny = Callable[[str], "web.StreamResponse"]


def aiohttp_auth(
    token: str | None,
    protocol: str,
    deny: Deny,
    *,
    open_paths: Container[str] = (),
    query_param: str | None = None,
) -> Callable[..., Awaitable[web.StreamResponse]] | None:
    """An aiohttp middleware that answers `deny(message)` unless the request carries `token`
    (Authorization: Bearer, or `?<query_param>=` where allowed); None when no token is set.
    Runs before the handler reads the body, so a refused request costs no parsing."""
    if token is None:
        return None
    # local: aiohttp; `tokenwire --help` loads this module without it
    from aiohttp import web

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]):  # type: ignore[no-untyped-def]
        if request.path in open_paths:
            return await handler(request)
        presented: str | None = bearer(request.headers.get("Authorization"))  # type: ignore[assignment]
        if presented is None and query_param is not None:
            presented = request.query.get(query_param)
        if token_matches(token, presented):
            return await handler(request)
        refused(protocol, request.remote, f"{request.method} {request.path}", presented)
        return deny(UNAUTHENTICATED_MESSAGE)

    return middleware
