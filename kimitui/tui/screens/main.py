"""The main screen: chat on the left; model, throughput and hardware panels on the right.

Engine stats are polled (a cheap snapshot) twice a second; telemetry arrives as coalescing
messages from the sampler thread.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header

from kimitui.tui.chat.model_info import DEMO_NOTE, ModelInfo
from kimitui.tui.chat.token_energy import TokenEnergyMeter
from kimitui.tui.hardware.history import HISTORY_S
from kimitui.tui.messages import ReplyFinished, TelemetryUpdated
from kimitui.tui.screens.chats import ChatsScreen
from kimitui.tui.screens.settings import SettingsScreen
from kimitui.tui.widgets.chat.pane import ChatPane
from kimitui.tui.widgets.hardware.panel import HardwarePanel
from kimitui.tui.widgets.model_panel import ModelPanel
from kimitui.tui.widgets.throughput_panel import ThroughputPanel

STATS_PERIOD_S = 0.5


def welcome_text(info: ModelInfo) -> str:
    where = f"{info.name} at {info.remote}" if info.remote else info.name
    lines = [
        f"{where} is ready. Type below: Enter sends, Shift+Enter or Ctrl+J adds a newline.",
        "Esc stops a reply, Ctrl+N starts a new chat, F2 changes sampling, F1 lists every key.",
    ]
    if info.is_demo and info.remote:
        lines.insert(0, f"The server runs kimitui's built-in demo checkpoint: {DEMO_NOTE}.")
    elif info.is_demo:
        lines.insert(
            0,
            f"This is the built-in demo checkpoint: {DEMO_NOTE}. "
            "It shows every part of kimitui working; run with --model DIR for a real Kimi.",
        )
    return "\n\n".join(lines)


class MainScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("f2", "settings", "Settings"),
        Binding("f3", "chats", "Chats"),
        Binding("ctrl+t", "toggle_thinking", "Thinking"),
        Binding("f5", "benchmark", "Benchmark"),
        Binding("f8", "toggle_graphs", "Graphs"),
        Binding("f9", "evaluation", "Evaluation"),
    ]

    def __init__(self, info: ModelInfo) -> None:
        super().__init__(id="main")
        self.info = info
        self.energy = TokenEnergyMeter()
        self.energy_window = TokenEnergyMeter(HISTORY_S)  # over the graphs' window
        self._unsubscribe = None

    def compose(self) -> ComposeResult:
        app = self.app
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="body"):
            yield ChatPane(app.bridge, app.chats, lambda: app.gen_settings, welcome_text(self.info), id="chat")
            with VerticalScroll(id="side"):
                yield ModelPanel(id="model-panel")
                yield ThroughputPanel(clock=app.clock, id="throughput")
                yield HardwarePanel(id="hardware")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ModelPanel).show(self.info)
        self.sub_title = self.info.name + ("  (demo: random weights, output is noise)" if self.info.is_demo else "")
        sampler = self.app.sampler
        if sampler is not None:
            # Runs on the sampler thread: post_message is the thread-safe way in.
            self._unsubscribe = sampler.subscribe(lambda s: self.post_message(TelemetryUpdated(s)))
            latest = sampler.latest()
            if latest is not None:
                self.post_message(TelemetryUpdated(latest))
        self._poll_stats()
        self.set_interval(STATS_PERIOD_S, self._poll_stats, name="engine-stats")
        self.query_one("#prompt").focus()

    def on_unmount(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()

    def _poll_stats(self) -> None:
        stats = self.app.stats_source()
        if stats is not None and stats.total_generation_tokens is not None:
            self.energy.record(self.app.clock(), stats.total_generation_tokens)
            self.energy_window.record(self.app.clock(), stats.total_generation_tokens)
        self.query_one(ThroughputPanel).update_stats(stats)

    def on_telemetry_updated(self, msg: TelemetryUpdated) -> None:
        sample = msg.sample
        history = self.app.sampler.history(since_t=sample.t - self.energy_window.window_s - 5)
        self.query_one(HardwarePanel).update_sample(
            sample,
            self.energy.joules_per_token(history, sample.t),
            self.energy_window.joules_per_token(history, sample.t),
        )

    def on_reply_finished(self, msg: ReplyFinished) -> None:
        self.query_one(ThroughputPanel).update_reply(msg)
        if msg.error:
            self.notify(msg.error, title="Reply failed", severity="error")

    # -- actions -------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return True if self.app.bridge.generating else None
        return True

    def action_stop(self) -> None:
        if self.app.bridge.stop():
            self.notify("Stopped.", timeout=2)

    async def action_new_chat(self) -> None:
        self.app.bridge.stop()
        self.app.chats.new()
        await self.query_one(ChatPane).show_current()

    def action_chats(self) -> None:
        async def chosen(chat_id: int | None) -> None:
            if chat_id is None or chat_id == self.app.chats.current.id:
                return
            self.app.bridge.stop()
            self.app.chats.select(chat_id)
            await self.query_one(ChatPane).show_current()

        self.app.push_screen(ChatsScreen(self.app.chats), chosen)

    def action_settings(self) -> None:
        def chosen(settings) -> None:
            if settings is not None:
                self.app.gen_settings = settings
                self.query_one(ChatPane).show_status()
                self.notify("Settings saved for the next reply.", timeout=2)

        self.app.push_screen(SettingsScreen(self.app.gen_settings, self.app.bridge.effort_supported), chosen)

    def action_toggle_thinking(self) -> None:
        s = self.app.gen_settings
        self.app.gen_settings = s.with_(thinking=not s.thinking)
        self.query_one(ChatPane).show_status()
        self.notify(f"Thinking {'on' if not s.thinking else 'off'} for the next reply.", timeout=2)

    def action_toggle_graphs(self) -> None:
        shown = self.query_one(HardwarePanel).toggle_graphs()
        self.notify(f"Hardware: {'history graphs' if shown else 'compact rows'}", timeout=2)

    def action_benchmark(self) -> None:
        from kimitui.tui.screens.benchmark import BenchmarkScreen

        self.app.push_screen(BenchmarkScreen())

    def action_evaluation(self) -> None:
        from kimitui.tui.screens.evaluation import EvaluationScreen

        self.app.push_screen(EvaluationScreen())
