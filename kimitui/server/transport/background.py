"""Uvicorn in a background thread: used by ``kimitui serve`` (the main thread keeps the signals)
and by tests and the TUI, which need a real server next to other work.

Shutdown is graceful: stop accepting, let running requests finish for ``shutdown_timeout``
seconds, then end what still runs as a client can read it (a stream gets an error event and
``[DONE]``, a waiting request a 503; ServerState.begin_shutdown), so nobody is cut off mid-event.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn

log = logging.getLogger(__name__)

# Default grace period: open requests get this long to finish on shutdown, then they are ended.
GRACEFUL_SHUTDOWN_S = 3
# Uvicorn's own deadline comes this much later, as a backstop: it cancels whatever is still running.
_BACKSTOP_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn.Server that tells the app when shutdown starts (in the server's event loop)."""

    def __init__(self, config: uvicorn.Config, app_state, grace_s: float):
        super().__init__(config)
        self.app_state = app_state
        self.grace_s = grace_s

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await warm_up(self.config.app)
        await super().serve(sockets)

    def end_requests_now(self) -> None:
        """From any thread: end the grace period now (a second Ctrl-C)."""
        loop = getattr(self, "loop", None)
        if self.app_state is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.app_state.end_now)
        else:
            self.force_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.app_state is not None:
            self.app_state.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


async def warm_up(app) -> None:
    """One ``GET /health`` through ``app``'s routes in process, before any client connects. FastAPI
    builds its middleware stack, and each route's matching context (importing as it goes), on the
    first request that reaches them: 6-10 ms that the first client's request paid here. The router
    alone, not the middleware: a Host allow-list would refuse the request before it got there."""
    router = getattr(app, "router", None)
    if router is None:
        return
    if getattr(app, "middleware_stack", False) is None:
        app.middleware_stack = app.build_middleware_stack()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/health",
        "raw_path": b"/health",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"localhost")],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "app": app,
        "state": {},
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        return None

    try:
        await router(scope, receive, send)
    except Exception:  # a warm-up only: the first real request then pays for it, as before
        log.debug("warming the app's routes failed", exc_info=True)


class BackgroundServer:
    """Bind ``host:port`` at construction (so "port in use" fails early with OSError), serve ``app``
    on ``start(app)``, stop on ``stop()``. Port 0 picks a free port; ``port`` then holds the real one."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "warning",
        shutdown_timeout: float = GRACEFUL_SHUTDOWN_S,
    ):
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # The protocol number matters: asyncio sets TCP_NODELAY on an accepted connection only
        # when its socket says IPPROTO_TCP (base_events._set_nodelay), and accept() copies it from
        # this socket. With proto 0 Nagle's algorithm held each response's body until the client's
        # delayed ACK of the headers came back: 40 ms on every reused connection. Linux also hands
        # the listening socket's TCP_NODELAY to accepted ones; set both.
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((host, port))
            # Listen now: with SO_REUSEADDR a bound but idle port could be bound again by a second
            # server. Connections made before start() wait in the backlog.
            self.sock.listen(2048)
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.log_level = log_level
        self.shutdown_timeout = shutdown_timeout
        self.server: _Server | None = None
        self._thread = threading.Thread(target=self._run, name="kimitui-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self, app, timeout: float = 30.0) -> BackgroundServer:
        # log_config=None: keep the process's logging setup (the CLI's --log-level) instead of
        # uvicorn's own handlers.
        from kimitui.server.transport.read_timeout import protocol_with_read_timeout

        app_state = getattr(getattr(app, "state", None), "server", None)
        if not hasattr(app_state, "begin_shutdown"):
            app_state = None  # not our app (the telemetry agent's): plain uvicorn shutdown
        # uvicorn's httptools (or h11) protocol, with the app's deadline for reading a request's head
        # (read_timeout.py); the app bounds the body itself (body.py). loop "auto": uvloop where installed.
        config = uvicorn.Config(
            app,
            log_level=self.log_level,
            log_config=None,
            lifespan="off",
            http=protocol_with_read_timeout(getattr(app_state, "request_read_timeout", None)),
            timeout_graceful_shutdown=self.shutdown_timeout + _BACKSTOP_S,
        )
        self.server = _Server(config, app_state, self.shutdown_timeout)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.url} stopped during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server on {self.url} did not start in {timeout} s")
            time.sleep(0.02)
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, let open requests finish for ``shutdown_timeout``, then end them."""
        if self.server is None:
            self.sock.close()
            return
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(self.shutdown_timeout + _BACKSTOP_S + 3 if timeout is None else timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(5)
        self.sock.close()

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until the server stops; short joins keep the main thread responsive to signals."""
        while self._thread.is_alive():
            self._thread.join(poll_s)
