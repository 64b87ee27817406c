"""A deadline for reading a request's head (request line and headers).

Uvicorn times out idle keep-alive connections but not a request that is being sent: a client that
opens a connection and sends half a header, or one byte a minute, holds the connection (and its
buffer) forever, and a few thousand such clients hold the server. Here every request head must
arrive within ``timeout`` seconds of its first byte (or of the connection opening); the body has
its own deadline in body.py. A late head gets ``408 Request Timeout`` and the connection closes.
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # optional: the C parser (llhttp) that uvicorn[standard] and vLLM use; h11 is pure Python
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed
    HttpToolsProtocol = None

log = logging.getLogger(__name__)

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


def http_protocol() -> type:
    """The HTTP/1.1 protocol class served: httptools' where it is installed (its C parser takes
    about 0.1 ms less per request than h11's Python one), else h11's. Both keep the request in
    ``self.cycle``, which is all the deadline below relies on."""
    return HttpToolsProtocol or H11Protocol


def protocol_with_read_timeout(timeout: float | None):
    """uvicorn's ``http`` setting: the protocol class of ``http_protocol()``, with a deadline for
    each request head unless ``timeout`` is None."""
    base = http_protocol()
    if timeout is None:
        return base
    if timeout <= 0:
        raise ValueError(f"the request read timeout must be > 0 seconds, got {timeout}")
    return type(f"ReadTimeout{base.__name__}", (_ReadTimeout, base), {"read_timeout_s": timeout})


class _ReadTimeout:
    """Mixin over uvicorn's H11Protocol or HttpToolsProtocol."""

    read_timeout_s: float = 60.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm()  # the first request's head is due from the moment the connection opens

    def data_received(self, data: bytes) -> None:
        if self._reading_head() and self._head_timer is None:
            self._arm()  # the next request on a kept-alive connection has started to arrive
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a head was complete: the app has the request now
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()  # idle from now on: uvicorn's keep-alive timeout applies

    def _reading_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._on_timeout)

    def _disarm(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _on_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head():
            return
        log.info("closing a connection from %s: no complete request head in %.0f s", self.client, self.read_timeout_s)
        body = (
            b'{"error": {"message": "request head not received within %d s", "type": '
            b'"invalid_request_error", "param": null, "code": "request_timeout"}}' % round(self.read_timeout_s)
        )
        self.transport.write(_TIMEOUT_RESPONSE % (len(body), body))
        self.transport.close()
