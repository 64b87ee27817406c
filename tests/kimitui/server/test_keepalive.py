"""Reused (keep-alive) connections answer at once: TCP_NODELAY on every accepted connection.

Without it Nagle's algorithm holds the body of each response until the client's delayed ACK of
the headers arrives, which on Linux is about 40 ms: every request after the first on a connection
was that late.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import httpx
import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.server import BackgroundServer, create_app

MODEL = "kimitui-demo"
# Linux's delayed ACK is 40 ms (TCP_DELACK_MIN); a stalled response takes at least that.
STALL_S = 0.040


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=256, max_num_seqs=2, kv_cache_tokens=1024))
    srv = BackgroundServer(port=0).start(create_app(llm, MODEL))
    yield srv
    srv.stop()
    llm.shutdown()


def _accepted_sockets(srv: BackgroundServer) -> list[socket.socket]:
    conns = list(srv.server.server_state.connections)
    return [c.transport.get_extra_info("socket") for c in conns if c.transport is not None]


def _timed(http: httpx.Client, method: str, path: str, **kw) -> float:
    t0 = time.perf_counter()
    r = http.request(method, path, **kw)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    return elapsed


def test_listening_socket_is_tcp(server):
    assert server.sock.proto == socket.IPPROTO_TCP
    assert server.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize(
    "method, path, kw",
    [
        ("GET", "/health", {}),
        ("GET", "/v1/models", {}),
        ("POST", "/tokenize", {"json": {"prompt": "hello there"}}),  # a body read, a JSON reply
    ],
)  # (not /v1/completions: its engine step alone can take 40 ms on a loaded 2-core machine)
def test_requests_on_one_connection_do_not_stall(server, method, path, kw):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        first = _timed(http, method, path, **kw)
        # The connection the server accepted has Nagle's algorithm off.
        accepted = _accepted_sockets(server)
        assert accepted and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)
        times = [_timed(http, method, path, **kw) for _ in range(9)]
        assert http.get("/health").status_code == 200
    # The median resists a contended machine's odd slow request; every stalled request takes
    # >= 40 ms, a prompt one takes about 1-5 ms here.
    median = statistics.median(times)
    assert median < STALL_S / 2, f"first {first * 1e3:.1f} ms, then {[round(t * 1e3, 1) for t in times]} ms"
    assert sum(t >= STALL_S for t in times) <= 2, [round(t * 1e3, 1) for t in times]


def test_served_by_httptools_on_uvloop(server):
    """The fast pair the project depends on (as uvicorn[standard] and vLLM): llhttp's C parser,
    with our request-head deadline mixed in, on libuv's event loop."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kimitui.server.transport.read_timeout import http_protocol, protocol_with_read_timeout

    assert http_protocol() is HttpToolsProtocol
    timed = protocol_with_read_timeout(5.0)
    assert issubclass(timed, HttpToolsProtocol) and timed.read_timeout_s == 5.0
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        conns = list(server.server.server_state.connections)
        assert conns and all(isinstance(c, HttpToolsProtocol) for c in conns)
    if os.name != "nt":
        import uvloop

        assert isinstance(server.server.loop, uvloop.Loop)
