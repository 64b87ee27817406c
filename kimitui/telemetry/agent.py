"""``kimitui agent``'s HTTP side: ``GET /metrics`` serves the sampler's latest sample as
Prometheus text (exposition.py), ``GET /health`` answers ok. With a token every request must
carry ``Authorization: Bearer <token>`` (compared in constant time); others get 401.

The standard library's threading HTTP server is enough for a few scrapers a second and keeps
the agent free of web-framework dependencies on GPU nodes.
"""

from __future__ import annotations

import hmac
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from kimitui.telemetry.exposition import render

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class AgentServer:
    """Bind at construction (a busy port fails at once, as OSError), serve on ``start()``."""

    def __init__(
        self,
        latest: Callable,
        host: str = "127.0.0.1",
        port: int = 9410,
        token: str | None = None,
        node: str | None = None,
    ) -> None:
        self.latest = latest
        self.token = token
        self.node = node or socket.gethostname()
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if agent.token and not _authorised(self.headers.get("Authorization", ""), agent.token):
                    return self._send(401, b"missing or wrong bearer token\n", "text/plain")
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    return self._send(200, render(agent.latest, agent.node), CONTENT_TYPE)
                if path == "/health":
                    return self._send(200, b"ok\n", "text/plain")
                self._send(404, b"not found: try /metrics\n", "text/plain")

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # scrapes every second would flood stderr
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        ThreadingHTTPServer.address_family = family
        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.host = host
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kimitui-agent", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "AgentServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _authorised(header: str, token: str) -> bool:
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
