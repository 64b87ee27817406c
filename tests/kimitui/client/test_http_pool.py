"""kimitui/client/http_pool.py against small asyncio servers that answer as told: connection reuse,
a kept-alive connection the server closed, each body framing, early exit, bad replies, timeouts."""

from __future__ import annotations

import asyncio
import json

import pytest

from kimitui.client.http_pool import HTTPConnectionError, HTTPPool, plain_http_target


class _Server:
    """Reads requests (head and Content-Length body) and answers each with ``reply(n, body)``'s bytes
    (``None``: close without answering); ``keep``: whether the connection stays open after a reply."""

    def __init__(self, reply, keep=True):
        self.reply, self.keep = reply, keep
        self.connections = 0
        self.requests: list[tuple[str, dict, bytes]] = []
        self.closed_by_client = 0

    async def _handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append((lines[0], headers, body))
                out = self.reply(len(self.requests), body)
                if out is None:
                    return
                for piece in out if isinstance(out, list) else [out]:
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
                if not self.keep:
                    return
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


def _chunked(*pieces: bytes) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for p in pieces:
        out += b"%x\r\n%s\r\n" % (len(p), p)
    return out + b"0\r\n\r\n"


def _sized(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_requests_share_one_kept_alive_connection_and_bodies_arrive_whole():
    async def main():
        async with _Server(lambda n, body: _chunked(b"data: one", b"\n\ndata: ", b"two\n\n", body)) as srv:
            pool = HTTPPool(srv.url + "/")
            bodies = []
            for i in range(5):
                resp = await pool.request("POST", "/v1/completions", {"Content-Type": "application/json"}, b"%d" % i)
                assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
                bodies.append(await resp.read())
            pool.close()
            return srv, bodies

    srv, bodies = asyncio.run(main())
    assert srv.connections == 1 and len(srv.requests) == 5
    assert bodies == [b"data: one\n\ndata: two\n\n%d" % i for i in range(5)]
    line, headers, _ = srv.requests[0]
    assert line == "POST /v1/completions HTTP/1.1" and headers["host"].startswith("127.0.0.1:")
    assert headers["content-type"] == "application/json" and headers["content-length"] == "1"


def test_a_kept_alive_connection_the_server_closed_is_replaced_once():
    async def main():
        # The server says keep-alive but closes after each reply, as uvicorn does after its idle timeout.
        async with _Server(lambda n, body: _sized(b"ok %d" % n), keep=False) as srv:
            pool = HTTPPool(srv.url)
            first = await (await pool.request("GET", "/a", {})).read()
            await asyncio.sleep(0.05)  # the close has reached the client: the idle connection is dropped
            second = await (await pool.request("GET", "/b", {})).read()
            # the close has not been seen yet when the next request goes out: it is sent again on a new one
            third_resp = await pool.request("GET", "/c", {})
            third = await third_resp.read()
            pool.close()
            return srv, [first, second, third]

    srv, bodies = asyncio.run(main())
    assert bodies == [b"ok 1", b"ok 2", b"ok 3"]
    assert srv.connections == 3


def test_a_stale_connection_that_breaks_as_the_request_goes_out_is_retried_on_a_new_one():
    async def main():
        async with _Server(lambda n, body: None if n == 2 else _sized(b"ok %d" % n)) as srv:
            pool = HTTPPool(srv.url)
            first = await (await pool.request("GET", "/a", {})).read()
            # the server reads request 2 on the kept connection and closes it without a byte back
            second = await (await pool.request("GET", "/b", {})).read()
            pool.close()
            return srv, first, second

    srv, first, second = asyncio.run(main())
    assert (first, second) == (b"ok 1", b"ok 3")
    assert srv.connections == 2
    assert [r[0] for r in srv.requests] == ["GET /a HTTP/1.1", "GET /b HTTP/1.1", "GET /b HTTP/1.1"]


def test_a_fresh_connection_closed_before_a_reply_is_an_error_not_a_retry():
    async def main():
        async with _Server(lambda n, body: None) as srv:
            pool = HTTPPool(srv.url)
            with pytest.raises(HTTPConnectionError, match="before replying"):
                await pool.request("POST", "/x", {}, b"{}")
            pool.close()
            return srv

    assert asyncio.run(main()).connections == 1


def test_close_delimited_and_sized_bodies_and_error_statuses():
    async def main():
        replies = {
            1: b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
            2: _sized(b'{"error": "no"}', "404 Not Found"),
        }
        async with _Server(lambda n, body: replies[json.loads(body)["n"]], keep=False) as srv:
            pool = HTTPPool(srv.url)
            a = await pool.request("POST", "/", {}, b'{"n": 1}')
            a_body = await a.read()
            b = await pool.request("POST", "/", {}, b'{"n": 2}')
            b_body = await b.read()
            pool.close()
            return (a.status, a_body), (b.status, b.reason, b_body)

    a, b = asyncio.run(main())
    assert a == (200, b"until the end")
    assert b == (404, "Not Found", b'{"error": "no"}')


def test_leaving_a_body_early_closes_the_connection():
    async def main():
        pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n", 0.5, b"0\r\n\r\n"]
        async with _Server(lambda n, body: pieces) as srv:
            pool = HTTPPool(srv.url)
            resp = await pool.request("POST", "/", {}, b"{}")
            async for piece in resp.chunks():
                assert piece == b"first"
                break
            for _ in range(100):
                if srv.closed_by_client:
                    break
                await asyncio.sleep(0.01)
            again = await (await pool.request("POST", "/", {}, b"{}")).read()  # on a new connection
            pool.close()
            return srv, again

    srv, again = asyncio.run(main())
    assert srv.closed_by_client == 1 and srv.connections == 2 and again == b"first"


def test_an_invalid_reply_and_a_reply_cut_short_are_errors():
    async def main():
        replies = {1: b"NOT HTTP AT ALL\r\n\r\n", 2: [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"]}
        async with _Server(lambda n, body: replies[n], keep=False) as srv:
            pool = HTTPPool(srv.url)
            with pytest.raises(HTTPConnectionError, match="invalid HTTP reply"):
                await pool.request("GET", "/", {})
            resp = await pool.request("GET", "/", {})
            with pytest.raises(HTTPConnectionError, match="during the reply"):
                await resp.read()
            pool.close()

    asyncio.run(main())


def test_a_reply_slower_than_the_timeout_raises_timeout_error():
    async def main():
        async with _Server(lambda n, body: [b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab", 2.0, b"cd"]) as srv:
            pool = HTTPPool(srv.url)
            resp = await pool.request("GET", "/", {}, timeout=0.2)
            with pytest.raises(TimeoutError, match="0.2 s"):
                await resp.read()
            pool.close()

    asyncio.run(main())


def test_a_pool_used_from_a_second_event_loop_opens_new_connections():
    import threading

    replies = []
    ready = threading.Event()
    holder = {}

    def serve() -> None:
        async def main():
            async with _Server(lambda n, body: _sized(b"ok %d" % n)) as srv:
                holder["srv"] = srv
                ready.set()
                while not holder.get("done"):
                    await asyncio.sleep(0.01)

        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    ready.wait(10)
    pool = HTTPPool(holder["srv"].url)

    async def one():
        replies.append(await (await pool.request("GET", "/", {})).read())

    asyncio.run(one())  # its connection stays idle in the pool, bound to a loop that is now closed
    asyncio.run(one())
    pool.close()
    holder["done"] = True
    thread.join(10)
    assert replies == [b"ok 1", b"ok 2"] and holder["srv"].connections == 2


def test_connection_refused_names_the_server():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(HTTPConnectionError, match=f"could not connect to 127.0.0.1:{port}"):
            await HTTPPool(f"http://127.0.0.1:{port}").request("GET", "/", {})

    asyncio.run(main())


def test_which_targets_the_pool_serves(monkeypatch):
    for k in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    assert plain_http_target("http://127.0.0.1:8000")
    assert plain_http_target("http://[::1]:8000/v1")
    assert not plain_http_target("https://example.com")
    monkeypatch.setenv("http_proxy", "http://proxy:3128")
    assert not plain_http_target("http://example.com:8000")
    monkeypatch.setenv("no_proxy", "example.com")
    assert plain_http_target("http://example.com:8000")
    with pytest.raises(ValueError, match="not a plain http"):
        HTTPPool("https://example.com")
