"""History graphs of the hardware panel (F8): per-GPU power with the power cap drawn across it,
per-GPU utilisation and memory use, and the node total power, over the last minutes.

Braille line plots from textual-plot; one colour per GPU, the same in every plot. The x axis is
seconds before now. Plots are redrawn only while visible.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plot import HiResMode, PlotWidget

from kimitui.tui.hardware.history import HardwareHistory

COLOURS = ("cyan", "magenta", "yellow", "green", "bright_blue", "bright_red", "bright_cyan", "bright_magenta")
CAP_STYLE = "red"


def _gaps_dropped(xs: list[float], ys: list[float | None]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


class HardwareGraphs(Vertical):
    DEFAULT_CSS = """
    HardwareGraphs { height: auto; }
    HardwareGraphs PlotWidget { height: 11; }
    HardwareGraphs .graph-title { color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        for key, title in (
            ("power", "power W per GPU (red: power cap)"),
            ("util", "utilisation % per GPU"),
            ("mem", "memory used % per GPU"),
            ("node", "node total W (GPUs + CPU package)"),
        ):
            yield Static(title, classes="graph-title", markup=False)
            yield PlotWidget(id=f"graph-{key}", allow_pan_and_zoom=False)

    def on_mount(self) -> None:
        for plot in self.query(PlotWidget):
            plot.margin_top, plot.margin_bottom, plot.margin_left = 0, 2, 6  # the title is above it

    def draw(self, history: HardwareHistory, now: float) -> None:
        window = history.window_s
        for key, which in (("power", 1), ("util", 2), ("mem", 3)):
            plot = self.query_one(f"#graph-{key}", PlotWidget)
            plot.clear()
            top = 100.0
            for index, name, xs, ys in history.series(which, now):
                xs, ys = _gaps_dropped(xs, ys)
                if xs:
                    plot.plot(xs, ys, line_style=COLOURS[index % len(COLOURS)], hires_mode=HiResMode.BRAILLE)
                    top = max(top, max(ys))
            if key == "power":
                for cap in history.power_caps():
                    plot.plot([-window, 0.0], [cap, cap], line_style=CAP_STYLE, hires_mode=HiResMode.BRAILLE)
                    top = max(top, cap)
            plot.set_xlimits(-window, 0.0)
            plot.set_ylimits(0.0, top * 1.05 if key == "power" else 100.0)
        plot = self.query_one("#graph-node", PlotWidget)
        plot.clear()
        xs, ys = _gaps_dropped(*history.node_series(now))
        if xs:
            plot.plot(xs, ys, line_style="white", hires_mode=HiResMode.BRAILLE)
        plot.set_xlimits(-window, 0.0)
        plot.set_ylimits(0.0, max(ys) * 1.1 if ys else 1.0)
