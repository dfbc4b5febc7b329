"""The gate every request passes before any handler runs: API key and body size.

A serialized trace is code; the replica runs it against the engine. So the key
check comes first, before a byte of the body is read, on every route but
``/health`` and ``/ping`` (a load balancer's probe carries no secret) and a
result download (its URL is the capability), and on the ``remote=True``
websocket (refused in a way nnsight's client reports as ``RemoteError``). The key is compared
with ``hmac.compare_digest`` so the time taken says nothing about how much of a
guess was right. nnsight's client sends it as ``ndif-api-key``; an OpenAI
client sends ``Authorization: Bearer <key>``; both are accepted. With
``api_keys={name: key}`` each tenant has its own key, and the key's name is
the tenant the handlers see (``tenant(scope)``; ``tenants.py`` uses it).

The size limit is enforced twice, because ``Content-Length`` is optional (a
chunked upload has none) and can lie: a declared length over the limit is
refused at once, and the body actually received is counted as it streams in,
the request failing with 413 the moment it crosses the limit, so a replica
never buffers more than ``max_body_bytes`` of one request.

A plain ASGI middleware (no Serve, no Ray), so it is unit-tested on its own.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable, Mapping, Union

__all__ = ["API_KEY_HEADER", "BodyTooLarge", "DEFAULT_TENANT", "GuardMiddleware", "check_api_key", "declared_length",
           "identify", "tenant"]

API_KEY_HEADER = "ndif-api-key"
DEFAULT_TENANT = "default"  # the tenant of the one key `api_key` sets
TENANT_STATE = "nnsight_tenant"  # where the middleware leaves the tenant: scope["state"] (Starlette's request.state)
OPEN_PATHS = frozenset({"/health", "/ping"})
# A result download (remote=True): nnsight's client sends no header there; the
# unguessable, single-use, expiring token in the path is the capability.
OPEN_PREFIXES = ("/download/",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BodyTooLarge(Exception):
    """The request body crossed ``max_body_bytes``."""

    def __init__(self, limit: int, seen: int) -> None:
        super().__init__(f"request body exceeds the limit of {limit} bytes (at least {seen} sent); "
                         "send less, or raise max_body_bytes in build_app's arguments")
        self.limit = limit
        self.seen = seen


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: ``ndif-api-key``, else an ``Authorization: Bearer`` token."""
    key = _header(headers, API_KEY_HEADER.encode())
    if key:
        return key.strip()
    authorization = _header(headers, b"authorization")
    if authorization:
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
    return None


Keys = Union[str, Mapping[str, str], None]


def key_names(expected: Keys) -> dict[str, str] | None:
    """``{tenant: key}``: one key is the tenant ``"default"``; None or no key leaves the routes open."""
    if not expected:
        return None
    return {DEFAULT_TENANT: expected} if isinstance(expected, str) else dict(expected)


def identify(headers: list[tuple[bytes, bytes]], expected: Keys) -> tuple[str | None, tuple[int, str] | None]:
    """``(tenant, None)`` if the request may proceed (tenant: its key's name; None when open), else
    ``(None, (status, detail))``: 401 missing, 403 wrong. Every key is compared, in constant time each."""
    keys = key_names(expected)
    if keys is None:
        return None, None
    presented = presented_key(headers)
    if presented is None:
        return None, (401, f"API key required: send it in the {API_KEY_HEADER} header (nnsight: api_key=... with "
                      "serve=, NDIF_API_KEY or CONFIG.API.APIKEY with remote=True)")
    tenant = None
    for name, key in keys.items():
        if hmac.compare_digest(presented, key.encode()) and tenant is None:
            tenant = name
    return (tenant, None) if tenant is not None else (None, (403, "invalid API key"))


def check_api_key(headers: list[tuple[bytes, bytes]], expected: Keys) -> tuple[int, str] | None:
    """``None`` if the request may proceed, else ``(status, detail)``: 401 missing, 403 wrong."""
    return identify(headers, expected)[1]


def tenant(scope: Scope) -> str | None:
    """The tenant ``GuardMiddleware`` identified a request as (its key's name); None on open routes."""
    return (scope.get("state") or {}).get(TENANT_STATE)


def declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """``Content-Length`` as an int, ``None`` when absent; ``-1`` when malformed."""
    value = _header(headers, b"content-length")
    if value is None:
        return None
    try:
        length = int(value)
    except ValueError:
        return -1
    return length if length >= 0 else -1


def route_path(scope: Scope) -> str:
    """The path below the application's route prefix (Serve passes it as ``root_path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "") or ""
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _refuse_subscription(receive: Receive, send: Send, status: int, detail: str) -> None:
    """A websocket without the key: no subscription, and a refusal nnsight's client reports clearly.

    Refusing the handshake itself (403) would surface in nnsight's
    ``RemoteBackend`` as websocket-client's ``WebSocketBadStatusException``,
    not as the ``RemoteError`` every other refusal is. So the socket is
    accepted, answers an empty ``session_id`` (no session is opened; the
    refusal is in ``detail``) and closes (1008, policy violation): the client
    then posts its request with the same key and gets the 401/403 and this
    message as ``RemoteError("Failed to send request: ...")``. Nothing runs.
    """
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps({"session_id": "", "status": status, "detail": detail})})
    await send({"type": "websocket.close", "code": 1008, "reason": detail[:120]})


class GuardMiddleware:
    """Refuse unauthenticated and oversized requests before the application sees them.

    Args:
        app: The ASGI application to guard.
        api_key: Required key, or ``{tenant: key}`` (each tenant its own key), or ``None`` to leave the
            routes open. The tenant a request's key names is in ``scope["state"]`` (``tenant(scope)``).
        max_body_bytes: Largest body accepted; larger ones get 413.
    """

    def __init__(self, app: Any, api_key: Keys, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            who, refusal = identify(scope.get("headers", []), self.api_key)
            if refusal is not None:
                await _refuse_subscription(receive, send, *refusal)
                return
            scope.setdefault("state", {})[TENANT_STATE] = who
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", [])
        path = route_path(scope)
        if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            who, refusal = identify(headers, self.api_key)
            if refusal is not None:
                await _reply(send, *refusal)
                return
            scope.setdefault("state", {})[TENANT_STATE] = who
        length = declared_length(headers)
        if length == -1:
            await _reply(send, 400, "malformed Content-Length header")
            return
        if length is not None and length > self.max_body_bytes:
            await _reply(send, 413, str(BodyTooLarge(self.max_body_bytes, length)))
            return

        seen = 0
        started = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes, seen)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge as error:
            if started:
                raise
            await _reply(send, 413, str(error))
