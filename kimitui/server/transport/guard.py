"""Requests refused before any route runs: while the server shuts down (503), and with a Host
allow-list (``--allowed-hosts``), a Host header not on it (400, as Starlette's TrustedHostMiddleware
answers; it stops DNS-rebinding pages from reaching a server bound to localhost)."""

from __future__ import annotations

import json

from kimitui.server.errors import error_body


class RequestGuard:
    """Pure ASGI middleware (no per-chunk cost for streams, unlike BaseHTTPMiddleware)."""

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await _respond(send, *refusal)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> tuple[int, dict, str] | None:
        if self.state.closing:
            return 503, error_body(503, "the server is shutting down", code="server_shutting_down"), "close"
        allowed = self.state.allowed_hosts
        if allowed is not None:
            host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1").lower()
            if host not in allowed and host.rsplit(":", 1)[0].strip("[]") not in allowed:
                shown = host.encode("ascii", "replace").decode()[:100]
                return (
                    400,
                    error_body(
                        400,
                        f"Host {shown!r} is not served here (kimitui serve --allowed-hosts)",
                        param="Host",
                        code="invalid_host",
                    ),
                    "keep-alive",
                )
        return None


async def _respond(send, status: int, body: dict, connection: str) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", connection.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def parse_allowed_hosts(text: str | None) -> frozenset[str] | None:
    """``--allowed-hosts`` (comma-separated host names, optionally with a port) as a set; None or
    empty (or "*") accepts any Host."""
    if not text or text.strip() == "*":
        return None
    hosts = frozenset(h.strip().lower() for h in text.split(",") if h.strip())
    bad = [h for h in hosts if not h.isascii() or any(c.isspace() for c in h) or "/" in h]
    if bad:
        raise ValueError(f"--allowed-hosts: {bad[0]!r} is not a host name")
    return hosts or None
