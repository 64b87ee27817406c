"""Issue 41's two acceptance figures for `kimitui serve`'s server on the demo model:

1. three requests on one kept-alive connection (curl's `time_total` of three `/health` requests on
   one connection), each under 5 ms;
2. streaming TTFT over HTTP within 2 ms of the same request made in process
   (`AsyncLLM.generate`), medians of alternating rounds (in process, httpx client in this
   process, httpx client in a process of its own, raw socket client, `kimitui bench`'s client in a
   process of its own, with its connection pool and with aiohttp (`vllm bench serve`'s library), in
   turn, so a change in the machine's speed hits all of them). A client in the server's process
   shares its GIL with the server's and the engine's threads; a real client does not, which the
   separate process shows. Each client's own time is in its figure: the raw socket client has next
   to none, so its difference is the server's.

The last lines print both figures and whether each holds. `--stages` also splits the HTTP TTFT
into where the time goes on the server (ASGI entry, the handler, the engine's first output, the
first SSE bytes handed to the socket). `--as-before` makes the listening socket as it was made
before 2026-12-04 (protocol number 0, no TCP_NODELAY), to show the 40 ms delayed-ACK stall; since the
server runs on uvloop (2026-12-06), which sets TCP_NODELAY on every TCP transport it makes itself
(uvloop/handles/tcp.pyx, TCPTransport.new), the stall shows only where uvloop is not installed.

    python benchmarks/server/http_keepalive.py [--as-before] [--stages] [--runs 3] [--pairs 40]
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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


_ROW: contextvars.ContextVar[dict | None] = contextvars.ContextVar("row", default=None)


class _Stages:
    """ASGI middleware (outermost) that timestamps each request: entry into the app, the handler's
    call of ``AsyncLLM.start`` (or ``generate``'s first read) and its first output (through wrapped ones), and the
    first SSE event handed to uvicorn. One dict per request, in ``rows``."""

    def __init__(self, app, llm: AsyncLLM):
        self.app, self.rows = app, []
        generate = llm.generate

        async def timed_generate(*args, **kwargs):
            row = _ROW.get()  # None for the in-process calls
            if row is not None:
                row["generate"] = time.perf_counter()
            async for out in generate(*args, **kwargs):
                if row is not None and "first_output" not in row:
                    row["first_output"] = time.perf_counter()
                yield out

        llm.generate = timed_generate
        start = llm.start

        def timed_start(*args, **kwargs):  # the eager form the streaming handlers call
            row = _ROW.get()
            if row is not None:
                row["generate"] = time.perf_counter()
            return _TimedStream(start(*args, **kwargs), row)

        llm.start = timed_start

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (b"x-stages", b"1") not in scope["headers"]:  # the raw client's only
            return await self.app(scope, receive, send)
        row = {"entry": time.perf_counter()}
        _ROW.set(row)  # the handler's tasks copy this context
        self.rows.append(row)

        async def timed_send(message):
            if (
                "first_event" not in row
                and message["type"] == "http.response.body"
                and message.get("body", b"").startswith(b"data: {")
            ):
                row["first_event"] = time.perf_counter()
            await send(message)

        await self.app(scope, receive, timed_send)


class _TimedStream:
    """A RequestStream that stamps its first output into ``row``."""

    def __init__(self, stream, row):
        self.stream, self.row = stream, row

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self.stream.__anext__()
        if self.row is not None and "first_output" not in self.row:
            self.row["first_output"] = time.perf_counter()
        return out

    async def aclose(self):
        await self.stream.aclose()


class _ClientProcess:
    """An httpx client (or, ``bench`` set, kimitui bench's client with that HTTP client: "auto" or
    "aiohttp") in a process of its own, one request per ``ttft()`` call."""

    def __init__(self, url: str, body: dict, bench: str | None = None):
        kind = ["--client-of"] if bench is None else ["--bench-client-of", bench]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *kind, url, json.dumps(body)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ttft(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


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
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"X-Stages: 1\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode() + data
        self.address = (host, int(port))
        self._connect()

    def _connect(self) -> None:
        self.sock = socket.create_connection(self.address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ttft(self) -> float:
        t0 = self.sent = time.perf_counter()
        self.sock.sendall(self.request)
        seen, ttft = b"", None
        while not seen.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
            data = self.sock.recv(65536)
            if not data:  # the server closed the idle connection (uvicorn: after 5 s): again on a new one
                if seen:
                    raise ConnectionError("the server closed the connection during a reply")
                self.sock.close()
                self._connect()
                return self.ttft()
            seen += data
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


def _bench_client_loop(http_client: str, url: str, body: dict) -> int:
    """As ``_client_loop`` with ``kimitui bench``'s client (kimitui.bench.clients): its TTFT, the first
    message carrying ``choices``, as `vllm bench serve` times it."""
    from kimitui.bench import OpenAICompletionsClient
    from kimitui.bench.workload import SampleRequest

    request = SampleRequest(None, body["prompt"], len(body["prompt"]), body["max_tokens"])

    async def serve() -> None:
        client = OpenAICompletionsClient(url, "demo", temperature=body["temperature"], http_client=http_client)
        loop = asyncio.get_running_loop()
        try:
            for i in range(10**9):
                if not await loop.run_in_executor(None, sys.stdin.readline):
                    return
                out = await client(request, f"bench-{i}")
                if not out.success:
                    raise RuntimeError(out.error)
                print(out.ttft, flush=True)
        finally:
            await client.aclose()

    asyncio.run(serve())
    return 0


def _client_loop(url: str, body: dict) -> int:
    """The separate process's side: one request per line read from stdin, its TTFT written back."""
    with httpx.Client(timeout=60) as http:
        for _ in sys.stdin:
            print(_http_ttft(http, url, body), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--client-of"]:
        return _client_loop(sys.argv[2], json.loads(sys.argv[3]))
    if sys.argv[1:2] == ["--bench-client-of"]:
        return _bench_client_loop(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-before", action="store_true", help="the listening socket as before the fix")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pairs", type=int, default=40, help="alternating rounds of in-process / HTTP TTFT")
    p.add_argument("--stages", action="store_true", help="split the raw client's HTTP TTFT into server stages")
    args = p.parse_args()
    if args.as_before:
        import kimitui.server.transport.background as bg

        bg.socket = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
        bg.socket.socket = _SocketAsBefore
    llm = AsyncLLM(engine_args=EngineArgs(max_num_seqs=4))
    app = create_app(llm, "demo")
    stages = None
    if args.stages:
        app.add_middleware(_Stages, llm=llm)
        app.middleware_stack = app.build_middleware_stack()  # built now (not at the first request) to find ours
        stages = _find(app.middleware_stack, _Stages)
    srv = BackgroundServer(port=0).start(app)
    try:
        keepalive = []
        for _ in range(args.runs):
            out = subprocess.run(
                ["curl", "-s", *["-o", "/dev/null"] * 3, "-w", "%{time_total}\n", *[srv.url + "/health"] * 3],
                capture_output=True,
                text=True,
            ).stdout.split()
            keepalive.append([float(t) * 1e3 for t in out])
            print("curl /health x3 on one connection (ms):", " / ".join(f"{t:.1f}" for t in keepalive[-1]))
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True, "ignore_eos": True, "temperature": 0}
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        http_ttft, local_ttft = [], []
        raw_ttft = []
        loop = asyncio.new_event_loop()  # the in-process caller's loop, as an application keeps one
        raw = _RawClient(srv.url, body)
        other = _ClientProcess(srv.url, body)
        bench = _ClientProcess(srv.url, body, bench="auto")
        aio = _ClientProcess(srv.url, body, bench="aiohttp")
        other_ttft, bench_ttft, aio_ttft = [], [], []
        with httpx.Client(timeout=60) as http:
            http_ttft.append(_http_ttft(http, srv.url, body))  # the connects, not counted
            raw_ttft.append(raw.ttft())
            other_ttft.append(other.ttft())
            bench_ttft.append(bench.ttft())
            aio_ttft.append(aio.ttft())
            sent = []
            for i in range(args.pairs):  # alternating, so a change in the machine's speed hits all three
                local_ttft.append(loop.run_until_complete(_local_ttft(llm, [5, 6, 7, 8], params, f"local-{i}")))
                http_ttft.append(_http_ttft(http, srv.url, body))
                other_ttft.append(other.ttft())
                raw_ttft.append(raw.ttft())
                sent.append(raw.sent)
                bench_ttft.append(bench.ttft())
                aio_ttft.append(aio.ttft())
        raw.close()
        other.close()
        bench.close()
        aio.close()
        loop.close()
        here = statistics.median(local_ttft)
        print(f"streaming TTFT, medians of {args.pairs} alternating rounds: in process {here * 1e3:.2f} ms")
        diffs = {}
        for name, ts in (
            ("httpx client in this process", http_ttft[1:]),
            ("httpx client in its own process", other_ttft[1:]),
            ("raw socket client", raw_ttft[1:]),
            ("kimitui bench's client in its own process", bench_ttft[1:]),
            ("kimitui bench's client with aiohttp in its own process", aio_ttft[1:]),
        ):
            there = statistics.median(ts)
            diffs[name] = (there, there - here)
            print(f"  HTTP on one connection, {name}: {there * 1e3:.2f} ms, {(there - here) * 1e3:+.2f} ms")
        if stages is not None:
            _print_stages(stages.rows[-args.pairs :], sent, raw_ttft[1:], here)
        worst = max(max(run) for run in keepalive)
        print("acceptance (issue 41):")
        print(
            f"  three requests on one kept-alive connection, worst of {args.runs} runs: {worst:.2f} ms "
            f"-> {'holds' if worst < 5 else 'FAILS'} (each under 5 ms)"
        )
        for name, (there, diff) in diffs.items():
            print(
                f"  streaming TTFT: in process {here * 1e3:.2f} ms, HTTP ({name}) {there * 1e3:.2f} ms, "
                f"difference {diff * 1e3:+.2f} ms -> {'holds' if diff <= 0.002 else 'FAILS'} (within 2 ms)"
            )
    finally:
        srv.stop()
        llm.shutdown()
    return 0


def _find(app, kind):
    while app is not None and not isinstance(app, kind):
        app = getattr(app, "app", None)
    return app


def _print_stages(rows: list[dict], sent: list[float], ttfts: list[float], local: float) -> None:
    """Medians of each stage of the raw client's requests, in ms."""
    rows = [dict(r, sent=s, received=s + t) for r, s, t in zip(rows, sent, ttfts) if "first_event" in r]
    spans = [
        ("client send -> app entry (socket, uvicorn's HTTP parse)", "sent", "entry"),
        ("app entry -> engine request added (middleware, auth, body, validation)", "entry", "generate"),
        ("generate() -> first output (the engine, as in process)", "generate", "first_output"),
        ("first output -> first SSE event sent (SSE framing)", "first_output", "first_event"),
        ("first SSE event sent -> client has it (uvicorn write, socket)", "first_event", "received"),
    ]
    print(
        f"  server stages of the raw client's HTTP TTFT (medians of {len(rows)} requests; in process "
        f"{local * 1e3:.2f} ms):"
    )
    for label, a, b in spans:
        print(f"    {label}: {statistics.median(r[b] - r[a] for r in rows) * 1e3:.3f} ms")


if __name__ == "__main__":
    sys.exit(main())
