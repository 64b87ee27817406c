"""Progress of the running benchmark: requests done of total, elapsed, ETA, and the engine's live
output tok/s and the measured power next to it (n/a without telemetry)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static

from kimitui.tui.formatting import NA, duration, num


def sample_power_w(sample) -> float | None:
    """GPU board power plus CPU package power of one telemetry Sample; None when nothing reads."""
    if sample is None:
        return None
    parts = [g.power_w for g in sample.gpus if g.power_w is not None]
    if sample.cpu_power_w is not None:
        parts.append(sample.cpu_power_w)
    return sum(parts) if parts else None


def seconds(value: float | None) -> str:
    """Short runs in tenths (0.4s), long ones as 2m05s."""
    if value is None:
        return NA
    return f"{value:.1f}s" if value < 10 else duration(value)


def eta_s(done: int, total: int, elapsed_s: float) -> float | None:
    # Requests of one run are alike, so the mean time per finished request predicts the rest.
    if done <= 0 or elapsed_s <= 0:
        return None
    return elapsed_s / done * (total - done)


class BenchProgress(Vertical):
    DEFAULT_CSS = """
    BenchProgress { height: auto; border: round $panel-lighten-2; border-title-color: $primary; padding: 0 1; }
    BenchProgress #bench-progress-bar { width: 1fr; }
    BenchProgress #bench-progress-bar Bar { width: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield Static("idle: pick a preset or fill the form, then Run (Ctrl+R)", id="bench-status", markup=False)
        # A known total from the start: an indeterminate bar animates (and redraws) forever.
        yield ProgressBar(total=1, show_eta=False, id="bench-progress-bar")
        yield Static("", id="bench-counts", markup=False)
        yield Static(f"live  output {NA} tok/s   power {NA} W", id="bench-live", markup=False)

    def on_mount(self) -> None:
        self.border_title = "progress"

    def start(self, description: str, total: int) -> None:
        self.query_one("#bench-status", Static).update(f"preparing prompts: {description}")
        self.query_one(ProgressBar).update(total=total, progress=0)
        self.query_one("#bench-counts", Static).update(f"0/{total} requests")

    def update_progress(
        self, phase: str, done: int, total: int, elapsed_s: float, point: int, num_points: int, description: str
    ) -> None:
        where = f"point {point}/{num_points}: " if num_points > 1 else ""
        state = "preparing prompts and warm-ups" if phase == "preparing" else "running"
        self.query_one("#bench-status", Static).update(f"{state}: {where}{description}")
        self.query_one(ProgressBar).update(total=total, progress=done)
        eta = eta_s(done, total, elapsed_s)
        self.query_one("#bench-counts", Static).update(
            f"{done}/{total} requests   elapsed {seconds(elapsed_s)}   ETA {seconds(eta)}"
        )

    def update_live(self, output_tok_s: float | None, power_w: float | None) -> None:
        self.query_one("#bench-live", Static).update(
            f"live  output {num(output_tok_s, '.1f', 'tok/s')}   power {num(power_w, '.0f', 'W')}"
        )

    def finish(self, text: str) -> None:
        self.query_one("#bench-status", Static).update(text)
