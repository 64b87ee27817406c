"""``kimitui`` with no subcommand: build the app from the CLI flags and run it."""

from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager
from pathlib import Path

from kimitui.paths import tui_log_file


@contextmanager
def logging_to_file(path: Path):
    """Textual draws on the terminal's stderr, so log records printed there would tear the
    screen: while the app runs, the root logger writes to a file instead."""
    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved
        handler.close()


def run_tui(args: argparse.Namespace) -> int:
    """Run the TUI until the user quits; returns the process exit status."""
    from kimitui.commands.engine_flags import engine_args_from
    from kimitui.telemetry import TelemetrySampler
    from kimitui.tui.app import KimiApp

    engine_args = engine_args_from(args)  # bad flag values fail here, before the screen opens
    interval = getattr(args, "telemetry_interval", None) or 1.0
    urls = getattr(args, "telemetry_url", None) or []
    if urls:
        from kimitui.telemetry.remote import RemoteTelemetry

        backends = [RemoteTelemetry(urls, token=getattr(args, "telemetry_token", None))]
    else:
        backends = None  # this machine's GPUs, CPU package and host
    bridge_factory = _remote_bridge_factory(args) if getattr(args, "base_url", None) else None
    with logging_to_file(tui_log_file()):
        sampler = TelemetrySampler(interval_s=interval, backends=backends)
        if bridge_factory is not None and getattr(args, "num_gpus", None) is None and urls:
            bridge_factory = _remote_bridge_factory(args, lambda: _gpus_seen(sampler))
        app = KimiApp(engine_args, theme=getattr(args, "theme", None), sampler=sampler, bridge_factory=bridge_factory)
        app.run()
    # The screen is gone; what is left is the interpreter's teardown, whose final garbage
    # collection walks every object a long session made (chat history, telemetry rings, Textual's
    # widgets): seconds on a busy machine before the shell prompt returns. Frozen objects are
    # skipped by that collection; the process is exiting, so nothing is lost.
    import gc

    gc.freeze()
    return app.return_code or 0


def _remote_bridge_factory(args: argparse.Namespace, num_gpus=None):
    """``--base-url``: the TUI over a server's API; bad URLs fail here, before the screen opens."""
    from kimitui.tui.bridges.remote import RemoteBridge

    if args.num_gpus is not None and args.num_gpus < 0:
        raise ValueError(f"--num-gpus must be >= 0, got {args.num_gpus}")
    gpus = args.num_gpus if args.num_gpus is not None else (num_gpus or 0)
    RemoteBridge(None, args.base_url)  # validates the URL
    return lambda app: RemoteBridge(app, args.base_url, api_key=args.api_key, model=args.model, num_gpus=gpus)


def _gpus_seen(sampler) -> int:
    latest = sampler.latest()
    return len(latest.gpus) if latest is not None else 0
