"""The benchmark screen (F5): presets and a form on the left; progress, results, the sweep
frontier and saved runs on the right. Runs go against what the chat already uses (the bridge's
engine or remote server), on a worker thread, so neither the UI nor the chat ever waits on it.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Static, TabbedContent, TabPane

from kimitui.tui.bench_job import BenchFinished, BenchJob, BenchProgressed
from kimitui.tui.bench_setup import config_from_form, default_form, describe
from kimitui.tui.widgets.bench_form import BenchForm
from kimitui.tui.widgets.bench_frontier import FrontierPanel
from kimitui.tui.widgets.bench_progress import BenchProgress, sample_power_w
from kimitui.tui.widgets.bench_saved import SavedRuns
from kimitui.tui.widgets.bench_tables import ResultTable

LIVE_PERIOD_S = 0.5
ESC_CONFIRM_S = 3.0  # a second Esc within this window cancels a running benchmark and leaves


class BenchmarkScreen(Screen):
    DEFAULT_CSS = """
    #bench-body { height: 1fr; }
    #bench-left { width: 64; min-width: 48; border: round $panel-lighten-2; border-title-color: $primary;
                  padding: 0 1; }
    #bench-right { width: 1fr; }
    #bench-tabs { height: 1fr; }
    #bench-result-note { color: $warning; height: auto; }
    """
    BINDINGS = [
        Binding("escape", "back", "Back to chat"),
        Binding("ctrl+r", "run", "Run"),
        Binding("ctrl+x", "cancel", "Cancel run"),
        Binding("f6", "next_tab", "Next tab"),
    ]
    TABS = ("tab-result", "tab-frontier", "tab-saved")

    def __init__(self) -> None:
        super().__init__(id="benchmark")
        self.job: BenchJob | None = None
        self.description = ""
        self.runs_finished = 0  # runs ended (finished, cancelled or failed) since the screen opened
        self._esc_armed_at = float("-inf")

    # -- target facts ----------------------------------------------------------------------
    @property
    def source(self):
        """What runs are made against: the bridge's engine or remote server (bridge_api.BenchSource)."""
        return self.app.bridge.bench_source()

    @property
    def max_model_len(self) -> int | None:
        return self.source.max_model_len

    @property
    def running(self) -> bool:
        return self.job is not None

    # -- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="bench-body"):
            with VerticalScroll(id="bench-left"):
                yield BenchForm(default_form(), self.max_model_len, id="bench-form")
            with Vertical(id="bench-right"):
                yield BenchProgress(id="bench-progress")
                with TabbedContent(id="bench-tabs", initial="tab-result"):
                    with TabPane("Result", id="tab-result"):
                        yield Static("No run yet: the result of the next run shows here.", id="bench-result-note",
                                     markup=False)
                        yield ResultTable(id="bench-result")
                    with TabPane("Frontier", id="tab-frontier"):
                        yield FrontierPanel(id="bench-frontier")
                    with TabPane("Saved runs", id="tab-saved"):
                        yield SavedRuns(id="bench-saved")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"benchmark: vllm bench serve metrics against {self.source.target}"
        context = f" (context {self.max_model_len:,} tokens)" if self.max_model_len else ""
        self.query_one("#bench-left").border_title = "workload" + context
        self.set_interval(LIVE_PERIOD_S, self._poll_live, name="bench-live")
        self.query_one("#bench-preset").focus()

    def on_unmount(self) -> None:
        if self.job is not None:  # leaving mid-run (app exit): do not leave requests behind
            self.job.cancel()

    # -- actions ---------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "run":
            return None if self.running else True  # shown greyed while a run is going
        if action == "cancel":
            return True if self.running else None
        return True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "bench-run":
            self.action_run()
        elif event.button.id == "bench-cancel":
            self.action_cancel()

    def action_run(self) -> None:
        if self.running:
            return
        form = self.query_one(BenchForm)
        source = self.source
        if source.problem:
            form.show_error(source.problem)
            return
        try:
            config = config_from_form(form.values(), max_model_len=source.max_model_len,
                                      num_gpus=source.num_gpus, model=source.model_name)
        except ValueError as e:
            form.show_error(str(e))
            return
        form.show_error(None)
        self.description = describe(config)
        self.job = BenchJob(config, source, self.app.sampler, notify=self)
        form.set_running(True)
        self.query_one(BenchProgress).start(self.description, config.num_prompts)
        self.query_one("#bench-result-note", Static).update("")
        self.refresh_bindings()
        self.run_worker(self.job.run, thread=True, group="benchmark", exit_on_error=False, name="benchmark")

    def action_cancel(self) -> None:
        if self.job is not None and not self.job.cancel_requested:
            self.job.cancel()
            self.query_one(BenchProgress).finish("cancelling: aborting the requests in flight…")

    def action_next_tab(self) -> None:
        tabs = self.query_one(TabbedContent)
        tabs.active = self.TABS[(self.TABS.index(tabs.active) + 1) % len(self.TABS)]
        if tabs.active == "tab-saved":
            # Space ticks runs straight away; the list can take focus once its pane is shown.
            self.call_after_refresh(self.query_one("#bench-saved-list").focus)

    def action_back(self) -> None:
        if self.running:
            now = time.monotonic()
            if now - self._esc_armed_at > ESC_CONFIRM_S:
                self._esc_armed_at = now
                self.notify("A benchmark is running: press Esc again to cancel it and go back.", timeout=ESC_CONFIRM_S)
                return
            self.job.cancel()
        self.app.pop_screen()

    # -- messages from the job -------------------------------------------------------------
    def on_bench_progressed(self, msg: BenchProgressed) -> None:
        if self.job is None or self.job.cancel_requested:
            return
        self.query_one(BenchProgress).update_progress(msg.phase, msg.done, msg.total, msg.elapsed_s,
                                                       msg.point, msg.num_points, self.description)

    def on_bench_finished(self, msg: BenchFinished) -> None:
        self.job = None
        self.runs_finished += 1
        self.query_one(BenchForm).set_running(False)
        self.refresh_bindings()
        progress = self.query_one(BenchProgress)
        if msg.error:
            progress.finish(f"failed: {msg.error}")
            self.notify(msg.error, title="Benchmark failed", severity="error")
            return
        if msg.results:  # the last progress message may have been coalesced away: show the end state
            last = msg.results[-1]
            progress.update_progress("running", last.get("completed", 0) + last.get("failed", 0),
                                     last.get("num_prompts", 0), float(last.get("duration", 0.0)),
                                     len(msg.results), len(msg.results), self.description)
        done = sum(r.get("completed", 0) for r in msg.results)
        state = "cancelled" if msg.cancelled else "finished"
        progress.finish(f"{state}: {self.description}; {done} request(s) completed, "
                        f"{len(msg.saved)} run(s) saved")
        self.query_one(ResultTable).show(msg.results)
        notes = [n for n in {r.get("notes") for r in msg.results} if n]
        if msg.cancelled:
            notes.insert(0, "cancelled: the numbers cover the requests that finished; not saved" if msg.results
                         else "cancelled before the timed window started: nothing was measured")
        self.query_one("#bench-result-note", Static).update("\n".join(notes))
        tabs = self.query_one(TabbedContent)
        if msg.sweep is not None:
            self.query_one(FrontierPanel).show(msg.sweep)
            tabs.active = "tab-frontier"
        else:
            tabs.active = "tab-result"
        if msg.saved:
            self.query_one(SavedRuns).reload()

    # -- live numbers ----------------------------------------------------------------------
    def _poll_live(self) -> None:
        stats = self.app.stats_source()
        sampler = self.app.sampler
        latest = sampler.latest() if sampler is not None else None
        self.query_one(BenchProgress).update_live(
            stats.decode_tokens_per_s if stats is not None else None, sample_power_w(latest))
