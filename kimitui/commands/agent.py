"""`kimitui agent`: this node's telemetry (GPU power, utilisation, memory, CPU package power) as
Prometheus metrics, for a TUI elsewhere (`kimitui --telemetry-url http://NODE:PORT`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "agent", help="serve this node's telemetry as Prometheus metrics", description=__doc__.splitlines()[0]
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=9410, help="TCP port (default %(default)s; 0 picks a free one)")
    p.add_argument(
        "--token",
        default=os.environ.get("KIMITUI_AGENT_TOKEN"),
        metavar="T",
        help="require 'Authorization: Bearer T' (default: $KIMITUI_AGENT_TOKEN)",
    )
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="sampling period in seconds")
    return p


def run(args: argparse.Namespace) -> int:
    from kimitui.telemetry import TelemetrySampler
    from kimitui.telemetry.agent import AgentServer

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    sampler = TelemetrySampler(interval_s=args.interval)  # ValueError on a bad interval
    server = AgentServer(sampler.latest, args.host, args.port, token=args.token)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sampler.start()
        server.start()
        found = [f"{b.name}: {b.detail}" for b in sampler.backends if b.available and b.detail]
        print(
            f"kimitui agent: node {server.node} at {server.url}/metrics{' (token required)' if args.token else ''}",
            flush=True,
        )
        print(f"kimitui agent: reading {'; '.join(found) or 'host only (no GPU telemetry found)'}", flush=True)
        if args.host not in _LOOPBACK and not args.token:
            print(f"kimitui agent: warning: listening on {args.host} without --token", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        server.stop()
        sampler.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("kimitui agent: stopped", flush=True)
    return 0
