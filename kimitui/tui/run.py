"""``kimitui`` with no subcommand: build the app from the CLI flags and run it."""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import contextmanager
from pathlib import Path


def log_path() -> Path:
    """``$XDG_STATE_HOME/kimitui/tui.log`` (XDG default ``~/.local/state``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "kimitui" / "tui.log"


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
    with logging_to_file(log_path()):
        sampler = TelemetrySampler(interval_s=getattr(args, "telemetry_interval", None) or 1.0)
        app = KimiApp(engine_args, theme=getattr(args, "theme", None), sampler=sampler)
        app.run()
    return app.return_code or 0
