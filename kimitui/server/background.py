"""Uvicorn in a background thread: used by ``kimitui serve`` (the main thread keeps the signals)
and by tests and the TUI, which need a real server next to other work."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

# Open streams get this long to finish on shutdown; then their connections are closed (which
# aborts their requests) so Ctrl-C never hangs on a long generation.
GRACEFUL_SHUTDOWN_S = 3


class BackgroundServer:
    """Bind ``host:port`` at construction (so "port in use" fails early with OSError), serve ``app``
    on ``start(app)``, stop on ``stop()``. Port 0 picks a free port; ``port`` then holds the real one."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
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
        self.server: uvicorn.Server | None = None
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
        config = uvicorn.Config(app, log_level=self.log_level, log_config=None, lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self.server = uvicorn.Server(config)
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

    def stop(self, timeout: float = GRACEFUL_SHUTDOWN_S + 5) -> None:
        """Stop accepting, let open requests finish briefly, then close them."""
        if self.server is None:
            self.sock.close()
            return
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout)
        self.sock.close()

    def wait(self, poll_s: float = 0.2) -> None:
        """Block until the server stops; short joins keep the main thread responsive to signals."""
        while self._thread.is_alive():
            self._thread.join(poll_s)
