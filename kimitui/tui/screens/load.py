"""Loading the model: a progress bar over bytes, tensors done / total, ETA; errors stay on screen."""

from __future__ import annotations

import time
from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Vertical
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from kimitui.paths import tui_log_file
from kimitui.tui.formatting import duration
from kimitui.tui.messages import EngineFailed, LoadProgressed, LoadStage


class LoadScreen(Screen):
    BINDINGS = [Binding("ctrl+q", "app.quit", "Quit")]

    def __init__(self, title: str, clock: Callable[[], float] = time.monotonic) -> None:
        """``title``: "Loading <model>" (or "Connecting to <url>" for a remote server)."""
        super().__init__(id="load")
        self.title_text = title
        self.clock = clock
        self._t0: float | None = None

    def compose(self) -> ComposeResult:
        with Center():
            with Vertical(id="load-box"):
                yield Static(self.title_text, id="load-title", markup=False)
                # Our own ETA below uses bytes/s since the first progress report; the bar's own
                # ETA would count from mount, including the time before any bytes moved.
                yield ProgressBar(total=None, show_eta=False, id="load-bar")
                yield Static("", id="load-detail", markup=False)
        yield Footer()

    def on_load_stage(self, stage: LoadStage) -> None:
        self.query_one("#load-detail", Static).update(stage.text)

    def on_load_progressed(self, p: LoadProgressed) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        self.query_one(ProgressBar).update(total=max(p.bytes_total, 1), progress=p.bytes_done)
        elapsed = now - self._t0
        rate = p.bytes_done / elapsed if elapsed > 0 else None
        eta = (p.bytes_total - p.bytes_done) / rate if rate else None
        self.query_one("#load-detail", Static).update(
            f"{p.bytes_done / 2**30:.2f} / {p.bytes_total / 2**30:.2f} GiB   "
            f"tensors {p.tensors_done} / {p.tensors_total}   "
            f"{(rate or 0) / 2**20:.0f} MiB/s   ETA {duration(eta)}"
        )

    def on_engine_failed(self, msg: EngineFailed) -> None:
        failed = self.title_text.replace("Loading", "Could not load", 1).replace(
            "Connecting to", "Could not connect to", 1
        )
        self.query_one("#load-title", Static).update(failed)
        self.query_one("#load-detail", Static).update(
            f"{msg.error}\n\nDetails in the log ({tui_log_file()}). Ctrl+Q quits; `kimitui --help` lists engine flags."
        )
        self.query_one(ProgressBar).display = False
        self.add_class("failed")
