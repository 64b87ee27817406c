"""Requests on one kept-alive connection to `kimitui serve`'s server: three `/health` requests via
curl (each one's `time_total`), and the streaming TTFT of a short prompt over one httpx connection.

`--as-before` makes the listening socket as it was made before 2026-12-04 (protocol number 0, no
TCP_NODELAY), to show the 40 ms delayed-ACK stall that asyncio's missing TCP_NODELAY caused.

    python benchmarks/http_keepalive.py [--as-before] [--runs 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from kimitui.engine import AsyncLLM, EngineArgs  # noqa: E402
from kimitui.server import BackgroundServer, create_app  # noqa: E402


class _SocketAsBefore(socket.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        super().__init__(family, type, 0 if proto == socket.IPPROTO_TCP else proto, fileno)

    def setsockopt(self, level, opt, *args):
        if level == socket.IPPROTO_TCP and opt == socket.TCP_NODELAY:
            return None
        return super().setsockopt(level, opt, *args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-before", action="store_true", help="the listening socket as before the fix")
    p.add_argument("--runs", type=int, default=3)
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
        ttfts = []
        with httpx.Client(timeout=60) as http:
            for _ in range(21):
                t0 = time.perf_counter()
                with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    for line in lines:
                        if line.startswith("data: {"):
                            ttfts.append(time.perf_counter() - t0)
                            break
                    for _ in lines:
                        pass
        print(f"streaming TTFT on one connection, median of 20: {statistics.median(ttfts[1:]) * 1e3:.1f} ms")
    finally:
        srv.stop()
        llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
