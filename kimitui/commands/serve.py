"""`kimitui serve`: the OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading

from kimitui.commands.engine_flags import add_engine_arguments, engine_args_from

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        description=__doc__.splitlines()[0],
    )
    add_engine_arguments(p, subcommand=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port (default %(default)s; 0 picks a free one)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("KIMITUI_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KIMITUI_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name clients send and /v1/models lists (default: --model, or the checkpoint's name)",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body accepted, larger ones get 413 (default %(default)s)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM / Ctrl-C, running requests get S seconds to finish; then streams end with an "
        "error event and [DONE], waiting requests get 503 (default %(default)s; a second "
        "Ctrl-C ends them at once)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
        metavar="S",
        help="seconds a client has to send a request's headers, and again its body; a late one gets "
        "408 (default %(default)s; 0: no limit)",
    )
    g.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="HOSTS",
        help="comma-separated Host header values served (e.g. localhost,127.0.0.1); others get 400. Default: any",
    )
    return p


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (bind() raises OverflowError, not OSError, beyond)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def check_api_key(key: str | None) -> None:
    """A key a client can send: HTTP header values are bytes that servers read as Latin-1, so a
    non-ASCII key (sent as UTF-8 by clients) could never compare equal; spaces would be cut."""
    if key is not None and not (key.isascii() and key.isprintable() and key == key.strip() and " " not in key):
        raise ValueError(
            "--api-key (or $KIMITUI_API_KEY) must be printable ASCII without spaces: HTTP clients "
            "cannot send other characters in the Authorization header"
        )


def run(args: argparse.Namespace) -> int:
    from kimitui.engine import AsyncLLM
    from kimitui.server import BackgroundServer, create_app
    from kimitui.server.transport.guard import parse_allowed_hosts

    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.request_read_timeout >= 0:
        raise ValueError(f"--request-read-timeout must be >= 0 seconds (0: no limit), got {args.request_read_timeout}")
    check_api_key(args.api_key)
    allowed_hosts = parse_allowed_hosts(args.allowed_hosts)
    engine_args = engine_args_from(args)  # validate flags before the slow load
    # Bind first: a busy port fails in a second, not after loading the model.
    server = BackgroundServer(
        args.host, args.port, log_level=_uvicorn_level(args.log_level), shutdown_timeout=args.shutdown_timeout
    )
    stop = threading.Event()
    loading = True
    started: list = []  # every process this one had started when a signal came

    def on_signal(signum, frame) -> None:
        if loading:
            # Loading can take minutes and spawns workers: unwind it (the finally below stops
            # what was started) instead of dying with children left behind. The process tree is
            # read first: unwinding kills a kernel build's ninja, whose compilers would then be
            # orphans, no longer our descendants.
            started.extend(descendants())
            raise _StopDuringStartup(signum)
        if stop.is_set() and server.server is not None:
            server.server.end_requests_now()  # second Ctrl-C: end open requests now
        stop.set()

    # Ours from the start: uvicorn's handlers re-raise the signal after shutting down (exit 130 /
    # killed by SIGTERM), and the default SIGTERM action would leave tensor-parallel workers and
    # the multiprocessing resource tracker running.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    llm = None
    try:
        print(f"kimitui serve: loading {args.model or 'the built-in demo model'} ...", flush=True)
        llm = AsyncLLM(engine_args=engine_args)
        loading = False
        name = args.served_model_name or args.model or llm.config.name
        server.start(
            create_app(
                llm,
                name,
                api_key=args.api_key,
                max_body_bytes=args.max_request_bytes,
                request_read_timeout=args.request_read_timeout or None,
                allowed_hosts=allowed_hosts,
            )
        )
        print(
            f"kimitui serve: model {name} at {server.url}/v1{' (API key required)' if args.api_key else ''}", flush=True
        )
        if llm.config.is_demo:
            print("kimitui serve: the demo model has random weights: its output is noise", flush=True)
        if args.host not in _LOOPBACK and not args.api_key:
            print(f"kimitui serve: warning: listening on {args.host} without --api-key", file=sys.stderr, flush=True)
        while not stop.is_set() and server.running:
            stop.wait(0.2)
        crashed = not stop.is_set()
    except _StopDuringStartup as e:
        print(f"kimitui serve: {signal.Signals(e.signum).name} during start-up: stopped", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        loading = False  # a signal from here on only asks for what is already under way
        server.stop()
        if llm is not None:
            llm.shutdown()
        stop_children(started)
        for s, handler in previous.items():
            signal.signal(s, handler)
        # What is left is the interpreter's teardown, whose final garbage collection walks every
        # object the engine made: 2.0 s at exit on a busy 2-core machine, 0.4 s with them frozen
        # (frozen objects are skipped; the process is exiting, so nothing is lost). A SIGTERM's
        # sender (systemd, Kubernetes, the shutdown test) waits for that exit.
        gc.freeze()
    if crashed:
        print("kimitui serve: the HTTP server stopped unexpectedly", file=sys.stderr, flush=True)
        return 1
    print("kimitui serve: stopped", flush=True)
    return 0


class _StopDuringStartup(BaseException):
    """SIGINT / SIGTERM while the model loads (a BaseException, like KeyboardInterrupt, so no
    ``except Exception`` in the loader swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def descendants() -> list:
    """This process's descendants now (psutil.Process objects)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def stop_children(also: list = (), grace_s: float = 3.0) -> None:
    """End every process this one started that is still alive: tensor-parallel ranks of a load
    interrupted halfway (no engine exists whose shutdown would stop them), and helpers such as a
    kernel compiler (ninja, c++) that a signal caught mid-build. Their exit also ends
    multiprocessing's resource tracker, which lives while any of them holds its pipe."""
    import multiprocessing

    import psutil

    for p in multiprocessing.active_children():
        p.terminate()  # multiprocessing's own handle reaps them (no zombies left in its table)
    children = {p.pid: p for p in [*also, *descendants()]}.values()  # psutil checks a pid was not reused
    tracker = _resource_tracker_pid()
    # The resource tracker exits on its own once its writers are gone (and then unlinks what it
    # tracks); killing it first could leave shared memory behind.
    helpers = [c for c in children if c.pid != tracker and c.is_running()]
    for c in helpers:
        try:
            c.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(helpers, timeout=grace_s)
    for c in alive:
        try:
            c.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=1.0)
    for p in multiprocessing.active_children():  # reap
        p.join(0.1)


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)


def _uvicorn_level(level: str | None) -> str:
    level = (level or "warning").lower()
    return level if level in ("critical", "error", "warning", "info", "debug", "trace") else "warning"
