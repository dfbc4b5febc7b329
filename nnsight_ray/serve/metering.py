"""Requests in flight and their latency, per route, as a plain ASGI middleware (no Serve, no Ray).

It wraps the application inside the API-key gate (refused requests are not
measured) and counts a request from its arrival until its response's last
byte, so a stream stays in flight until it ends. The metrics themselves are
defined in ``nnsight_ray._internal.observe.metrics`` (``docs/metrics.md``).
"""

from __future__ import annotations

from typing import Any

from .._internal.observe import metrics
from .security import Receive, Scope, Send, route_path

__all__ = ["MEASURED_ROUTES", "MetricsMiddleware"]

#: path -> (route tag, kind tag) of nnsight_requests_in_flight / nnsight_request_latency_seconds.
MEASURED_ROUTES = {
    "/v1/nnsight/generate": ("generate", "traced"),
    "/v1/completions": ("completions", "plain"),
    "/v1/chat/completions": ("chat", "plain"),
}


class MetricsMiddleware:
    """Record ``nnsight_requests_in_flight`` and ``nnsight_request_latency_seconds`` for the measured routes.

    Args:
        app: the ASGI application.
        replica: the ``replica`` tag (the replica's engine name).
    """

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        measured = MEASURED_ROUTES.get(route_path(scope)) if scope["type"] == "http" else None
        if measured is None:
            await self.app(scope, receive, send)
            return
        route, kind = measured
        with metrics.in_flight(route, kind, self.replica) as outcome:
            async def observed_send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    outcome["status"] = metrics.http_status(message["status"])
                await send(message)

            await self.app(scope, receive, observed_send)
