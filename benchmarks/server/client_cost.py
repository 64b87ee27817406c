"""What an HTTP client itself adds to a streamed request's TTFT: each client against one canned
server (a process of its own answering every POST with the same chunked SSE reply at once), in
turn, medians of alternating rounds. The raw socket client writes prepared bytes and scans the
reply, so its figure is the socket and the canned server; each other client's excess over it is its
own time, which any TTFT it measures includes.

    python benchmarks/server/client_cost.py [--rounds 300]
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BODY = {"model": "demo", "prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True, "temperature": 0}
_EVENT = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "demo"}


def _canned_server() -> int:
    """The server side (``--serve``): prints its port, then answers each request on each connection."""
    import threading

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def event(obj: dict) -> bytes:
        return chunk(b"data: " + json.dumps({**_EVENT, **obj}).encode() + b"\n\n")

    token = event({"choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]})
    head = (
        b"HTTP/1.1 200 OK\r\ndate: Sun, 06 Dec 2026 00:00:00 GMT\r\nserver: uvicorn\r\ncache-control: no-cache\r\n"
        b"x-accel-buffering: no\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    rest = token * 3 + event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}})
    rest += chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = b""
        while True:
            data = conn.recv(65536)
            if not data:
                return
            pending += data
            while b"\r\n\r\n" in pending:
                request_head, pending = pending.split(b"\r\n\r\n", 1)
                length = next(
                    int(line.split(b":")[1])
                    for line in request_head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                while len(pending) < length:
                    pending += conn.recv(65536)
                pending = pending[length:]
                conn.sendall(head + token)
                conn.sendall(rest)

    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class _Raw:
    def __init__(self, port: int):
        data = json.dumps(BODY).encode()
        self.request = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def __call__(self) -> float:
        t0 = time.perf_counter()
        self.sock.sendall(self.request)
        seen, ttft = b"", None
        while not seen.endswith(b"0\r\n\r\n"):
            seen += self.sock.recv(65536)
            if ttft is None and b'"choices": [{' in seen:
                ttft = time.perf_counter() - t0
        return ttft


class _Bench:
    def __init__(self, port: int, http_client: str):
        from kimitui.bench import OpenAICompletionsClient
        from kimitui.bench.workload import SampleRequest

        self.client = OpenAICompletionsClient(
            f"http://127.0.0.1:{port}", "demo", temperature=0, http_client=http_client
        )
        self.request = SampleRequest(None, BODY["prompt"], 4, 4)

    async def __call__(self) -> float:
        out = await self.client(self.request, "r")
        if not out.success:
            raise RuntimeError(out.error)
        return out.ttft


class _Httpx:
    def __init__(self, port: int):
        import httpx

        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.http = httpx.AsyncClient(timeout=60)
        self.aclose = self.http.aclose

    async def __call__(self) -> float:
        t0 = time.perf_counter()
        ttft = None
        async with self.http.stream("POST", self.url, json=BODY) as r:
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - t0
        return ttft


async def _measure(port: int, rounds: int) -> dict[str, float]:
    clients = {
        "raw socket": _Raw(port),
        "kimitui bench (its pool)": _Bench(port, "auto"),
        "kimitui bench with aiohttp (vllm bench serve's library)": _Bench(port, "aiohttp"),
        "httpx (the openai SDK's library)": _Httpx(port),
    }
    times: dict[str, list[float]] = {name: [] for name in clients}
    for i in range(rounds + 5):
        for name, client in clients.items():
            t = await client()
            if i >= 5:  # the connects and first calls, not counted
                times[name].append(t)
    for client in clients.values():
        close = getattr(getattr(client, "client", None), "aclose", None) or getattr(client, "aclose", None)
        if close is not None:
            await close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        return _canned_server()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        medians = asyncio.run(_measure(port, args.rounds))
    finally:
        server.kill()
    base = medians["raw socket"]
    print(f"TTFT against a canned server, medians of {args.rounds} alternating rounds:")
    for name, t in medians.items():
        extra = "" if name == "raw socket" else f", the client's own +{(t - base) * 1e3:.2f} ms"
        print(f"  {name}: {t * 1e3:.3f} ms{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
