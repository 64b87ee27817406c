"""The kimitui app: a shell. Screens hold the UI, the bridge holds the engine (in process, or a
remote server's client: ``bridge_factory``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

from textual.app import App
from textual.binding import Binding

from kimitui.engine import EngineArgs
from kimitui.tui.bridges.base import Bridge
from kimitui.tui.bridges.local import EngineBridge, EngineFactory
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.session import ChatHistory
from kimitui.tui.messages import EngineReady
from kimitui.tui.palette import KimiCommands
from kimitui.tui.screens.help import HelpScreen
from kimitui.tui.screens.load import LoadScreen
from kimitui.tui.screens.main import MainScreen
from kimitui.tui.theming import initial_theme, register_themes, save_theme


class KimiApp(App):
    """``sampler``: a started-or-not TelemetrySampler (the app starts and stops it) or None.
    ``stats_source``/``clock`` default to the engine's stats and ``time.monotonic``; tests
    replace them to get frozen screens."""

    CSS_PATH = "app.tcss"
    TITLE = "kimitui"
    COMMANDS = App.COMMANDS | {KimiCommands}
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("f4", "next_theme", "Theme"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        theme: str | None = None,
        sampler=None,
        engine_factory: EngineFactory | None = None,
        stats_source: Callable | None = None,
        clock: Callable[[], float] = time.monotonic,
        settings_file: Path | None = None,
        user_themes: Path | None = None,
        generation: GenerationSettings | None = None,
        bridge_factory: Callable[[App], Bridge] | None = None,
    ) -> None:
        super().__init__()
        self.engine_args = engine_args
        self.requested_theme = theme
        self.sampler = sampler
        self.clock = clock
        self.settings_file = settings_file
        self.user_themes = user_themes
        self.bridge: Bridge = (
            bridge_factory(self) if bridge_factory is not None else EngineBridge(self, engine_args, engine_factory)
        )
        self.stats_source = stats_source or self.bridge.stats
        self.chats = ChatHistory()
        self.gen_settings = generation or GenerationSettings()

    def on_mount(self) -> None:
        for problem in register_themes(self, self.user_themes):
            self.notify(problem, title="Theme skipped", severity="warning")
        self.theme, warning = initial_theme(self, self.requested_theme, self.settings_file)
        if warning:
            self.notify(warning, severity="warning")
        # Subscribed after the initial theme is set: only the user's own choices are saved.
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        if self.sampler is not None:
            self.sampler.start()
        loading = LoadScreen(self.bridge.load_title, self.clock)
        self.push_screen(loading)
        self.bridge.load(notify=loading)  # EngineReady bubbles up from the load screen to here
        if not self.is_headless:
            self.set_interval(1.0, self._exit_if_terminal_gone)

    def _exit_if_terminal_gone(self) -> None:
        # A hung-up terminal (tmux killed, ssh dropped) leaves Textual's input thread reading EOF in
        # a busy loop that keeps a core at 100%; quit instead, shutting the engine down.
        try:
            gone = not os.isatty(sys.__stdin__.fileno())
        except (AttributeError, OSError, ValueError):
            gone = True
        if gone:
            self.exit()

    def on_unmount(self) -> None:
        self.bridge.shutdown()
        if self.sampler is not None:
            self.sampler.stop()

    def on_engine_ready(self, msg: EngineReady) -> None:
        self.switch_screen(MainScreen(msg.info))

    def _theme_changed(self, theme) -> None:
        error = save_theme(theme.name, self.settings_file)
        if error:
            self.notify(error, title="Theme not saved", severity="warning")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_set_theme(self, name: str) -> None:
        self.theme = name

    def action_next_theme(self) -> None:
        ours = ["kimitui-dark", "kimitui-light", "instinct-red"]
        names = [n for n in ours if n in self.available_themes]
        names += sorted(n for n in self.available_themes if n not in names)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self.notify(f"Theme: {self.theme}", timeout=2)
