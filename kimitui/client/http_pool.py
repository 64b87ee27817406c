"""Kept-alive HTTP/1.1 connections for streamed requests to a plain ``http://`` server, on asyncio
with httptools' C parser (llhttp, the parser uvicorn serves with).

A benchmark's TTFT is timed by its client, so the client's own time is in every figure. aiohttp, which
`vllm bench serve` uses, spends 0.9-1.2 ms more of a streamed request's TTFT on this project's 2-core
test host than this pool does (``benchmarks/server/client_cost.py`` times both against a canned server,
``benchmarks/server/http_keepalive.py`` against ``kimitui serve``).
The pool does what a benchmark needs and no more: one request at a time per connection, connections
reused while the server keeps them alive (a kept-alive one the server closed meanwhile is replaced
once, before any byte of the reply came), bodies sent whole, replies streamed as they arrive with
Content-Length, chunked or close-delimited framing. TLS and proxies stay with aiohttp
(``plain_http_target``).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections import deque
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

# A connection idle this long is closed rather than reused: uvicorn closes idle kept-alive
# connections after 5 s (its --timeout-keep-alive), and a request sent as the server closes would
# fail (or, without a byte back, be sent again on a new connection).
_IDLE_REUSE_S = 4.0
# Reply bytes buffered before the connection stops reading (the reader is slower than the server).
_HIGH_WATER = 1 << 20


class HTTPConnectionError(ConnectionError):
    """The connection failed or broke, or the reply was not valid HTTP/1.1."""


def plain_http_target(url: str) -> bool:
    """True when ``url`` is ``http://`` and no proxy from the environment applies to its host (as
    aiohttp's ``trust_env`` would use): the pool can serve it."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies()
    return "http" not in proxies or bool(urllib.request.proxy_bypass(parts.hostname))


class Response:
    """A reply whose head has arrived; its body streams through ``chunks()`` (or ``read()``).
    Leaving the body unread closes the connection (``close()``), which a server takes as the
    client gone."""

    def __init__(self, conn: _Connection, pool: HTTPPool):
        self._conn, self._pool = conn, pool
        self.status: int = conn.status
        self.reason: str = conn.reason
        self.headers: dict[str, str] = conn.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                data = await conn.next_body()
                if data is None:
                    break
                yield data
        finally:
            self.close()

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)


class HTTPPool:
    """Connections to one ``http://host:port`` server, opened as needed (no limit: the caller's
    concurrency is the cap) and kept while the server keeps them alive."""

    def __init__(self, base_url: str, connect_timeout: float = 30.0):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not a plain http:// URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = shown if parts.port is None else f"{shown}:{self.port}"
        self.connect_timeout = connect_timeout
        self._idle: deque[_Connection] = deque()
        self._closed = False

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes = b"", timeout: float | None = None
    ) -> Response:
        """Send one request and wait for its reply's head. ``timeout``: seconds for the whole
        exchange, body included (the connection is then closed and the body's reader gets
        ``TimeoutError``)."""
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host_header}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        while True:
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            conn.start(data, timeout)
            try:
                await conn.head()
            except HTTPConnectionError:
                conn.abort()
                if reused and not conn.received:
                    continue  # the server closed this kept-alive connection before reading the request
                raise
            except BaseException:
                conn.abort()
                raise
            return Response(conn, self)

    def release(self, conn: _Connection) -> None:
        """A connection's exchange is over: kept for the next request when its reply was read to the
        end and the server keeps it alive, else closed."""
        if conn.reusable() and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().abort()

    def _take_idle(self) -> _Connection | None:
        now, loop = time.monotonic(), asyncio.get_running_loop()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be timed out
            if conn.loop is loop and conn.alive() and now - conn.idle_since < _IDLE_REUSE_S:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), self.connect_timeout
            )
        except asyncio.TimeoutError:
            raise HTTPConnectionError(
                f"could not connect to {self.host_header} within {self.connect_timeout:g} s"
            ) from None
        except OSError as e:
            raise HTTPConnectionError(f"could not connect to {self.host_header}: {e.strerror or e}") from None
        return conn


class _Connection(asyncio.Protocol):
    """One TCP connection and the exchange on it (httptools' parser calls the ``on_*`` methods)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()  # a connection serves the event loop that made it
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._lost = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status, self.reason, self.headers = 0, "", {}
        self.keep_alive = False  # the parser's verdict, read with the head (it resets after the message)
        self.received = False  # a byte of this exchange's reply came
        self._head: asyncio.Future | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    # the exchange
    def start(self, data: bytes, timeout: float | None) -> None:
        self._reset()
        loop = asyncio.get_running_loop()
        self._head = loop.create_future()
        if timeout is not None:
            self._timer = loop.call_later(timeout, self._timed_out, timeout)
        if self._lost:
            self._fail(HTTPConnectionError("the server closed the connection"))
            return
        self.transport.write(data)

    async def head(self) -> None:
        await self._head

    async def next_body(self) -> bytes | None:
        """The next piece of the body, or None at its end."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._complete:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._body.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < _HIGH_WATER // 2:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self._complete and self._error is None and not self._lost and self.keep_alive

    def alive(self) -> bool:
        return not self._lost and self.transport is not None and not self.transport.is_closing()

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None and not self.loop.is_closed():
            self.transport.abort()  # (a closed loop's transport closes its socket when collected)

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(HTTPConnectionError(f"invalid HTTP reply: {e}"))
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self._lost = True
        if self._complete or self._error is not None or self._head is None:
            return
        headers_done = self._head.done()
        framed = "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "")
        if headers_done and not framed:
            self.on_message_complete()  # a close-delimited body ends with the connection
        else:
            reason = f": {exc}" if exc else ""
            where = "during the reply" if headers_done else "before replying"
            self._fail(HTTPConnectionError(f"the server closed the connection {where}{reason}"))

    # httptools callbacks
    def on_status(self, reason: bytes) -> None:
        self.reason = reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(bytes(body))
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        if self._timer is not None:
            self._timer.cancel()
        self._wake()

    # failures
    def _timed_out(self, timeout: float) -> None:
        self._fail(TimeoutError(f"no complete reply within {timeout:g} s"))
        self.transport.abort()

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._complete:
            self._error = error
            if self._head is not None and not self._head.done():
                self._head.set_exception(error)
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
