"""`kimitui serve`: the OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                              description=__doc__.splitlines()[0])
    add_engine_arguments(p, subcommand=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s; 0 picks a free one)")
    g.add_argument("--api-key", default=os.environ.get("KIMITUI_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KIMITUI_API_KEY)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients send and /v1/models lists (default: --model, or the checkpoint's name)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help="largest request body accepted, larger ones get 413 (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    from kimitui.engine import AsyncLLM
    from kimitui.server import BackgroundServer, create_app

    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    engine_args = engine_args_from(args)  # validate flags before the slow load
    # Bind first: a busy port fails in a second, not after loading the model.
    server = BackgroundServer(args.host, args.port, log_level=_uvicorn_level(args.log_level))
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set() and server.server is not None:
            server.server.force_exit = True  # second Ctrl-C: drop open streams now
        stop.set()

    try:
        print(f"kimitui serve: loading {args.model or 'the built-in demo model'} ...", flush=True)
        llm = AsyncLLM(engine_args=engine_args)
    except BaseException:
        server.stop()
        raise
    # uvicorn's own handlers re-raise the signal after shutting down (exit 130 / killed by
    # SIGTERM); ours let the engine stop cleanly and the command exit 0.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        name = args.served_model_name or args.model or llm.config.name
        server.start(create_app(llm, name, api_key=args.api_key, max_body_bytes=args.max_request_bytes))
        print(f"kimitui serve: model {name} at {server.url}/v1"
              f"{' (API key required)' if args.api_key else ''}", flush=True)
        if llm.config.is_demo:
            print("kimitui serve: the demo model has random weights: its output is noise", flush=True)
        if args.host not in _LOOPBACK and not args.api_key:
            print(f"kimitui serve: warning: listening on {args.host} without --api-key", file=sys.stderr,
                  flush=True)
        while not stop.is_set() and server.running:
            stop.wait(0.2)
        crashed = not stop.is_set()
    finally:
        server.stop()
        llm.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if crashed:
        print("kimitui serve: the HTTP server stopped unexpectedly", file=sys.stderr, flush=True)
        return 1
    print("kimitui serve: stopped", flush=True)
    return 0


def _uvicorn_level(level: str | None) -> str:
    level = (level or "warning").lower()
    return level if level in ("critical", "error", "warning", "info", "debug", "trace") else "warning"
