"""The evaluation screen (F9): is the serving path faithful? A small form on the left (which
evaluation, recall context lengths, KL prompts and decode tokens); on the right a progress bar,
the result (the KL table; the recall table and its per-depth plot) and the saved results, which
a selection shows again. Runs go on a worker thread (tui/evaluation/job.py), so the UI never waits."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import (
    Button,
    Footer,
    Header,
    Input,
    Label,
    OptionList,
    ProgressBar,
    Select,
    Static,
    TabbedContent,
    TabPane,
)

from kimitui.eval.recall import parse_context_lengths
from kimitui.tui.evaluation.job import EvalFinished, EvalJob, EvalProgressed, EvalSettings
from kimitui.tui.evaluation.store import list_results
from kimitui.tui.screens.job import JobScreen
from kimitui.tui.widgets.eval_views import kl_table, recall_plot, recall_table

WHICH = [("KL divergence and recall", "both"), ("KL divergence vs float32", "kl"), ("Long-context recall", "recall")]
DEFAULTS = {"context_lengths": "256,512", "num_prompts": "4", "prompt_len": "64", "decode_tokens": "8"}


def settings_from_form(which: str, values: dict[str, str]) -> EvalSettings:
    """The form's text as EvalSettings; ValueError (one line naming the field) on bad input."""
    kinds = {"both": ("kl", "recall"), "kl": ("kl",), "recall": ("recall",)}.get(which)
    if kinds is None:
        raise ValueError(f"evaluation must be one of both, kl, recall, got {which!r}")

    def positive(name: str, label: str, minimum: int = 1, allow_zero: bool = False) -> int:
        text = values.get(name, "").strip()
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"{label}: expected a whole number, got {text!r}") from None
        low = 0 if allow_zero else minimum
        if n < low:
            raise ValueError(f"{label}: must be at least {low}, got {n}")
        return n

    lengths = parse_context_lengths(values.get("context_lengths", ""))
    return EvalSettings(
        kinds,
        tuple(lengths),
        num_prompts=positive("num_prompts", "KL prompts"),
        prompt_len=positive("prompt_len", "KL prompt length", minimum=2),
        decode_tokens=positive("decode_tokens", "decode tokens", allow_zero=True),
    )


class EvaluationScreen(JobScreen):
    DEFAULT_CSS = """
    #eval-body { height: 1fr; }
    #eval-left { width: 44; border: round $panel-lighten-2; border-title-color: $primary; padding: 0 1; }
    #eval-left Input, #eval-left Select { margin-bottom: 1; }
    #eval-error { color: $error; height: auto; }
    #eval-hint { color: $text-muted; height: auto; margin-bottom: 1; }
    #eval-right { width: 1fr; }
    #eval-status { height: auto; }
    #eval-progress { margin: 0 1; }
    #eval-tabs { height: 1fr; }
    #eval-note { color: $warning; height: auto; }
    #eval-saved-list { height: 1fr; }
    """
    JOB_NAME, ID_PREFIX = "evaluation", "eval"  # keys and Esc: JobScreen

    def __init__(self) -> None:
        super().__init__(id="evaluation")
        self.last: EvalFinished | None = None
        self._saved = []

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with Horizontal(id="eval-body"):
            with VerticalScroll(id="eval-left"):
                yield Label("evaluation")
                yield Select(WHICH, value="both", allow_blank=False, id="eval-which")
                yield Label("recall context lengths (tokens)")
                yield Input(DEFAULTS["context_lengths"], id="eval-context_lengths")
                yield Label("KL prompts")
                yield Input(DEFAULTS["num_prompts"], id="eval-num_prompts")
                yield Label("KL prompt length (tokens)")
                yield Input(DEFAULTS["prompt_len"], id="eval-prompt_len")
                yield Label("KL decode-path tokens per prompt")
                yield Input(DEFAULTS["decode_tokens"], id="eval-decode_tokens")
                yield Static(
                    "KL loads a float32 reference and a copy of the path under test beside the chat's "
                    "model; recall asks the chat's model itself.",
                    id="eval-hint",
                    markup=False,
                )
                yield Static("", id="eval-error", markup=False)
                with Horizontal(id="eval-buttons"):
                    yield Button("Run", id="eval-run", variant="primary")
                    yield Button("Cancel", id="eval-cancel", disabled=True)
            with Vertical(id="eval-right"):
                yield Static("Idle: Ctrl+R runs the evaluation chosen on the left.", id="eval-status", markup=False)
                yield ProgressBar(total=1, show_eta=False, id="eval-progress")
                with TabbedContent(id="eval-tabs", initial="eval-tab-result"):
                    with TabPane("Result", id="eval-tab-result"):
                        with VerticalScroll():
                            yield Static("", id="eval-note", markup=False)
                            yield Static("No result yet.", id="eval-kl", markup=False)
                            yield Static("", id="eval-recall", markup=False)
                            yield Static("", id="eval-plot", markup=False)
                    with TabPane("Saved results", id="eval-tab-saved"):
                        yield OptionList(id="eval-saved-list")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "evaluation: KL against float32, long-context recall"
        self.query_one("#eval-left").border_title = "evaluation"
        self.reload_saved()
        self.query_one("#eval-which").focus()

    # -- form ------------------------------------------------------------------------------
    def form_values(self) -> dict[str, str]:
        return {name: self.query_one(f"#eval-{name}", Input).value for name in DEFAULTS}

    def set_form(self, which: str | None = None, **values: str) -> None:
        if which is not None:
            self.query_one("#eval-which", Select).value = which
        for name, value in values.items():
            self.query_one(f"#eval-{name}", Input).value = value

    # -- the job (JobScreen) ----------------------------------------------------------------
    def make_job(self) -> EvalJob | None:
        error = self.query_one("#eval-error", Static)
        try:
            settings = settings_from_form(str(self.query_one("#eval-which", Select).value), self.form_values())
        except ValueError as e:
            error.update(str(e))
            return None
        error.update("")
        self.query_one("#eval-status", Static).update("starting…")
        self.query_one(ProgressBar).update(total=1, progress=0)
        return EvalJob(settings, self.app.bridge, notify=self)

    def show_running(self, running: bool) -> None:
        self.query_one("#eval-run", Button).disabled = running
        self.query_one("#eval-cancel", Button).disabled = not running

    def show_cancelling(self) -> None:
        self.query_one("#eval-status", Static).update("cancelling: stopping at the next step…")

    # -- messages from the job -------------------------------------------------------------
    def on_eval_progressed(self, msg: EvalProgressed) -> None:
        if not self.wants_progress():
            return
        self.query_one(ProgressBar).update(total=max(1, msg.total), progress=msg.done)
        self.query_one("#eval-status", Static).update(f"{msg.label} ({msg.done}/{msg.total})")

    def on_eval_finished(self, msg: EvalFinished) -> None:
        self.last = msg
        status = self.query_one("#eval-status", Static)
        if not self.job_ended(msg):
            status.update(f"failed: {msg.error}")
            return
        state = "cancelled" if msg.cancelled else "finished"
        status.update(f"{state}: {len(msg.results)} result(s), {len(msg.saved)} saved")
        bar = self.query_one(ProgressBar)
        bar.update(total=1, progress=1)
        self.show_results(msg.results, msg.notes)
        self.query_one(TabbedContent).active = "eval-tab-result"
        if msg.saved:
            self.reload_saved()

    # -- results ---------------------------------------------------------------------------
    def show_results(self, results: list[dict], notes: list[str] = ()) -> None:
        """Show the KL and/or recall results given (a slot without a result is left empty)."""
        kl = next((r for r in results if r.get("kind") == "kl"), None)
        rc = next((r for r in results if r.get("kind") == "recall"), None)
        self.query_one("#eval-note", Static).update("\n".join(notes))
        self.query_one("#eval-kl", Static).update(kl_table(kl) + "\n" if kl else "")
        self.query_one("#eval-recall", Static).update(recall_table(rc) + "\n" if rc else "")
        self.query_one("#eval-plot", Static).update(recall_plot(rc) if rc else "")

    def reload_saved(self) -> None:
        self._saved = list_results()
        options = self.query_one("#eval-saved-list", OptionList)
        options.clear_options()
        options.add_options([s.title for s in self._saved] or ["(no saved results yet)"])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_list.id != "eval-saved-list" or not self._saved:
            return
        saved = self._saved[event.option_index]
        self.show_results([saved.result], [f"saved result {saved.path.name}"])
        self.query_one(TabbedContent).active = "eval-tab-result"
