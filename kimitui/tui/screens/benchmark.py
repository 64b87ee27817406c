"""The benchmark screen (F5): presets and a form on the left; progress, results, the sweep
frontier and saved runs on the right. Runs go against what the chat already uses (the bridge's
engine or remote server), on a worker thread, so neither the UI nor the chat ever waits on it.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from kimitui.tui.benchmark.job import BenchFinished, BenchJob, BenchProgressed
from kimitui.tui.benchmark.setup import config_from_form, default_form, describe
from kimitui.tui.screens.job import JobScreen
from kimitui.tui.widgets.bench.form import BenchForm
from kimitui.tui.widgets.bench.frontier import FrontierPanel
from kimitui.tui.widgets.bench.progress import BenchProgress, sample_power_w
from kimitui.tui.widgets.bench.saved import SavedRuns
from kimitui.tui.widgets.bench.tables import ResultTable

LIVE_PERIOD_S = 0.5


class BenchmarkScreen(JobScreen):
    DEFAULT_CSS = """
    #bench-body { height: 1fr; }
    #bench-left { width: 64; min-width: 48; border: round $panel-lighten-2; border-title-color: $primary;
                  padding: 0 1; }
    #bench-right { width: 1fr; }
    #bench-tabs { height: 1fr; }
    #bench-result-note { color: $warning; height: auto; }
    """
    BINDINGS = [Binding("f6", "next_tab", "Next tab")]  # with JobScreen's Esc, Ctrl+R, Ctrl+X
    TABS = ("tab-result", "tab-frontier", "tab-saved")
    JOB_NAME, ID_PREFIX = "benchmark", "bench"

    def __init__(self) -> None:
        super().__init__(id="benchmark")
        self.description = ""

    # -- target facts ----------------------------------------------------------------------
    @property
    def source(self):
        """What runs are made against: the bridge's engine or remote server (bridges.base.BenchSource)."""
        return self.app.bridge.bench_source()

    @property
    def max_model_len(self) -> int | None:
        return self.source.max_model_len

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
                        yield Static(
                            "No run yet: the result of the next run shows here.", id="bench-result-note", markup=False
                        )
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

    # -- the job (JobScreen) ----------------------------------------------------------------
    def make_job(self) -> BenchJob | None:
        form = self.query_one(BenchForm)
        source = self.source
        if source.problem:
            form.show_error(source.problem)
            return None
        try:
            config = config_from_form(
                form.values(), max_model_len=source.max_model_len, num_gpus=source.num_gpus, model=source.model_name
            )
        except ValueError as e:
            form.show_error(str(e))
            return None
        form.show_error(None)
        self.description = describe(config)
        self.query_one(BenchProgress).start(self.description, config.num_prompts)
        self.query_one("#bench-result-note", Static).update("")
        return BenchJob(config, source, self.app.sampler, notify=self)

    def show_running(self, running: bool) -> None:
        self.query_one(BenchForm).set_running(running)

    def show_cancelling(self) -> None:
        self.query_one(BenchProgress).finish("cancelling: aborting the requests in flight…")

    def action_next_tab(self) -> None:
        tabs = self.query_one(TabbedContent)
        tabs.active = self.TABS[(self.TABS.index(tabs.active) + 1) % len(self.TABS)]
        if tabs.active == "tab-saved":
            # Space ticks runs straight away; the list can take focus once its pane is shown.
            self.call_after_refresh(self.query_one("#bench-saved-list").focus)

    # -- messages from the job -------------------------------------------------------------
    def on_bench_progressed(self, msg: BenchProgressed) -> None:
        if not self.wants_progress():
            return
        self.query_one(BenchProgress).update_progress(
            msg.phase, msg.done, msg.total, msg.elapsed_s, msg.point, msg.num_points, self.description
        )

    def on_bench_finished(self, msg: BenchFinished) -> None:
        progress = self.query_one(BenchProgress)
        if not self.job_ended(msg):
            progress.finish(f"failed: {msg.error}")
            return
        if msg.results:  # the last progress message may have been coalesced away: show the end state
            last = msg.results[-1]
            progress.update_progress(
                "running",
                last.get("completed", 0) + last.get("failed", 0),
                last.get("num_prompts", 0),
                float(last.get("duration", 0.0)),
                len(msg.results),
                len(msg.results),
                self.description,
            )
        done = sum(r.get("completed", 0) for r in msg.results)
        state = "cancelled" if msg.cancelled else "finished"
        progress.finish(f"{state}: {self.description}; {done} request(s) completed, {len(msg.saved)} run(s) saved")
        self.query_one(ResultTable).show(msg.results)
        notes = [n for n in {r.get("notes") for r in msg.results} if n]
        if msg.cancelled:
            notes.insert(
                0,
                "cancelled: the numbers cover the requests that finished; not saved"
                if msg.results
                else "cancelled before the timed window started: nothing was measured",
            )
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
            stats.decode_tokens_per_s if stats is not None else None, sample_power_w(latest)
        )
