"""Requests on one kept-alive connection to `kimitui serve`'s server: three `/health` requests via
curl (each one's `time_total`), and the streaming TTFT of a short prompt over one httpx connection
against the same request made in process (`AsyncLLM.generate`), alternating.

`--as-before` makes the listening socket as it was made before 2026-12-04 (protocol number 0, no
TCP_NODELAY), to show the 40 ms delayed-ACK stall that asyncio's missing TCP_NODELAY caused.

    python benchmarks/http_keepalive.py [--as-before] [--runs 3] [--pairs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from kimitui.engine import AsyncLLM, EngineArgs, SamplingParams  # noqa: E402
from kimitui.server import BackgroundServer, create_app  # noqa: E402


class _SocketAsBefore(socket.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        super().__init__(family, type, 0 if proto == socket.IPPROTO_TCP else proto, fileno)

    def setsockopt(self, level, opt, *args):
        if level == socket.IPPROTO_TCP and opt == socket.TCP_NODELAY:
            return None
        return super().setsockopt(level, opt, *args)


def _http_ttft(http: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                ttft = time.perf_counter() - t0
                break
        for _ in lines:
            pass
    return ttft


class _RawClient:
    """One kept-alive TCP connection writing a prepared request and reading the chunked SSE reply
    itself: a client with next to no cost of its own, so the figure is the server's."""

    def __init__(self, url: str, body: dict):
        host, port = url.removeprefix("http://").split(":")
        data = json.dumps(body).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(data)}\r\n\r\n").encode() + data
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ttft(self) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.request)
        seen, ttft = b"", None
        while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
            seen += self.sock.recv(65536)
            if ttft is None and b"data: {" in seen:
                ttft = time.perf_counter() - t0
        return ttft

    def close(self) -> None:
        self.sock.close()


async def _local_ttft(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str) -> float:
    t0 = time.perf_counter()
    ttft = None
    async for _ in llm.generate(prompt, params, request_id):
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-before", action="store_true", help="the listening socket as before the fix")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=20, help="in-process / HTTP TTFT pairs")
    args = p.parse_args()
    if args.as_before:
        import kimitui.server.background as bg

        bg.socket = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
        bg.socket.socket = _SocketAsBefore
    llm = AsyncLLM(engine_args=EngineArgs(max_num_seqs=4))
    srv = BackgroundServer(port=0).start(create_app(llm, "demo"))
    try:
        for _ in range(args.runs):
            out = subprocess.run(["curl", "-s", *["-o", "/dev/null"] * 3, "-w", "%{time_total}\n",
                                  *[srv.url + "/health"] * 3], capture_output=True, text=True).stdout.split()
            print("curl /health x3 on one connection (ms):", " / ".join(f"{float(t) * 1e3:.1f}" for t in out))
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0}
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        http_ttft, local_ttft = [], []
        raw_ttft = []
        loop = asyncio.new_event_loop()  # the in-process caller's loop, as an application keeps one
        raw = _RawClient(srv.url, body)
        with httpx.Client(timeout=60) as http:
            http_ttft.append(_http_ttft(http, srv.url, body))  # the connects, not counted
            raw_ttft.append(raw.ttft())
            for i in range(args.pairs):  # alternating, so a change in the machine's speed hits all three
                local_ttft.append(loop.run_until_complete(_local_ttft(llm, [5, 6, 7, 8], params, f"local-{i}")))
                http_ttft.append(_http_ttft(http, srv.url, body))
                raw_ttft.append(raw.ttft())
        raw.close()
        loop.close()
        here = statistics.median(local_ttft)
        print(f"streaming TTFT, medians of {args.pairs} alternating rounds: in process {here * 1e3:.1f} ms")
        for name, ts in (("httpx client", http_ttft[1:]), ("raw socket client", raw_ttft[1:])):
            there = statistics.median(ts)
            print(f"  HTTP on one connection, {name}: {there * 1e3:.1f} ms, {(there - here) * 1e3:+.1f} ms")
    finally:
        srv.stop()
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
