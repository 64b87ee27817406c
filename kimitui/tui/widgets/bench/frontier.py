"""The throughput-vs-interactivity frontier of a sweep: a plot (x = tok/s per user, y = tok/s
per GPU, every measured point and the Pareto front through them), the points as numbers, and
InferenceX's ladder read off the front.

The plot is textual-plot's ``PlotWidget`` (braille lines, nice ticks, zoom/pan) when that package
is installed; without it a small character plot drawn here stands in, so the screen never needs it.
"""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from kimitui.bench.sweep import format_frontier, format_ladder, point_from_result

try:
    from textual_plot import HiResMode, PlotWidget
except ImportError:  # optional dependency: fall back to CharPlot
    PlotWidget = None

PLOT_BACKEND = "textual-plot" if PlotWidget is not None else "built-in character plot"


def char_plot(
    points: list[tuple[float, float, str]], front: list[tuple[float, float]], width: int = 60, height: int = 14
) -> str:
    """Points (x, y, tag) as tags on a character grid with zero-based axes; front points are '●'
    joined by '·' along straight segments."""
    if not points:
        return "(no points)"
    x_max = max(p[0] for p in points) * 1.1 or 1.0
    y_max = max(p[1] for p in points) * 1.1 or 1.0
    grid = [[" "] * width for _ in range(height)]

    def cell(x: float, y: float) -> tuple[int, int]:
        return (
            min(width - 1, int(x / x_max * (width - 1))),
            height - 1 - min(height - 1, int(y / y_max * (height - 1))),
        )

    for (x0, y0), (x1, y1) in zip(front, front[1:]):
        for k in range(1, 20):
            c, r = cell(x0 + (x1 - x0) * k / 20, y0 + (y1 - y0) * k / 20)
            grid[r][c] = "·"
    for x, y, tag in points:
        c, r = cell(x, y)
        mark = "●" if (x, y) in front else "○"
        for i, ch in enumerate(mark + tag):
            if c + i < width:
                grid[r][c + i] = ch
    y_label = f"{y_max:,.0f}"
    pad = len(y_label)
    rows = [
        f"{y_label if i == 0 else '0'.rjust(pad) if i == height - 1 else ' ' * pad} │{''.join(row)}"
        for i, row in enumerate(grid)
    ]
    rows.append(" " * pad + " └" + "─" * width)
    rows.append(" " * pad + f"  0{'tok/s per user':^{width - 12}}{x_max:,.1f}")
    return "tok/s per GPU\n" + "\n".join(rows)


class FrontierPanel(Vertical):
    DEFAULT_CSS = """
    FrontierPanel { height: 1fr; }
    FrontierPanel #bench-plot { height: 1fr; min-height: 12; }
    FrontierPanel #bench-frontier-text { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sweep: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        if PlotWidget is not None:
            yield PlotWidget(id="bench-plot")
        else:
            yield Static("", id="bench-plot", markup=False)
        yield Static(
            "Run a sweep (sweep concurrency 1,2,4,...) to see the frontier.", id="bench-frontier-text", markup=False
        )

    def show(self, sweep: dict[str, Any]) -> None:
        self.sweep = sweep
        points = [(p, point_from_result(p)) for p in sweep["points"]]
        measured = [(q.interactivity, q.tput_per_gpu, f"c{p.get('max_concurrency')}") for p, q in points if q]
        per = "GPU" if all(p.get("num_gpus", 1) for p in sweep["points"]) else "host"  # no GPU: host tok/s
        front = [(f["interactivity"], f["tput_per_gpu"]) for f in sweep["frontier"]]
        self._plot(measured, front)
        ladder = {float(k): v for k, v in sweep["ladder"].items()}
        self.query_one("#bench-frontier-text", Static).update(
            format_frontier(sweep["frontier"], per)
            + "\n"
            + format_ladder(ladder, per=per)
            + f"\n(plot: {PLOT_BACKEND})"
        )

    def _plot(self, measured: list[tuple[float, float, str]], front: list[tuple[float, float]]) -> None:
        plot = self.query_one("#bench-plot")
        if PlotWidget is None:
            plot.update(char_plot(measured, front))
            return
        plot.clear()
        if not measured:
            return
        primary = str(self.app.theme_variables.get("primary", "white"))
        accent = str(self.app.theme_variables.get("accent", "yellow"))
        plot.scatter(
            [m[0] for m in measured], [m[1] for m in measured], marker="○", marker_style=accent, label="measured"
        )
        if len(front) > 1:
            plot.plot(
                [f[0] for f in front],
                [f[1] for f in front],
                line_style=primary,
                hires_mode=HiResMode.BRAILLE,
                label="frontier",
            )
        plot.scatter([f[0] for f in front], [f[1] for f in front], marker="●", marker_style=primary)
        plot.set_xlimits(0, max(m[0] for m in measured) * 1.1)
        plot.set_ylimits(0, max(m[1] for m in measured) * 1.1)
        plot.set_xlabel("interactivity: tok/s per user (1000 / median TPOT)")
        plot.set_ylabel("tok/s per GPU")
        plot.show_legend()
