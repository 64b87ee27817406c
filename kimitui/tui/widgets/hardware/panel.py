"""Hardware: one row per GPU (power against its cap, utilisation, HBM, temperature), then the
host (CPU %, RAM, CPU package power), the node total power and energy per output token. F8
switches the GPU rows for history graphs (graphs.py) and back. Every missing reading
shows "n/a"."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from kimitui.tui.formatting import NA, bar, num, pct, used_total
from kimitui.tui.hardware.history import HardwareHistory, node_power
from kimitui.tui.widgets.hardware.graphs import HardwareGraphs

BAR_WIDTH = 8
JOULES_PER_KWH = 3.6e6


def gpu_line(g) -> str:
    frac = g.power_w / g.power_cap_w if g.power_w is not None and g.power_cap_w else None
    cap = f"/{g.power_cap_w:.0f}" if g.power_cap_w else ""
    power = f"{g.power_w:.0f}{cap} W" if g.power_w is not None else f"{NA} W"
    hbm = used_total(g.mem_used_bytes, g.mem_total_bytes, digits=0)
    return (
        f"GPU{g.index} {bar(frac, BAR_WIDTH)} {power:>10} util {pct(g.util_pct):>4} "
        f"HBM {hbm} {NA if g.temp_c is None else f'{g.temp_c:.0f}°C'}"
    )


def energy_line(label: str, joules_per_token: float | None) -> str:
    per_kwh = JOULES_PER_KWH / joules_per_token if joules_per_token else None
    return f"energy ({label})  {num(joules_per_token, '.3g', 'J')}/token  {num(per_kwh, ',.0f')} tokens/kWh"


class HardwarePanel(Vertical):
    def __init__(self, history: HardwareHistory | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.history = history if history is not None else HardwareHistory()
        self.graphs_shown = False
        self._now: float | None = None

    def compose(self) -> ComposeResult:
        yield Static("waiting for the first telemetry sample…", id="gpu-rows", markup=False)
        graphs = HardwareGraphs(id="hw-graphs")
        graphs.display = False
        yield graphs
        yield Static("", id="host-rows", markup=False)

    def on_mount(self) -> None:
        self.border_title = "hardware"

    def toggle_graphs(self) -> bool:
        """Compact rows <-> history graphs; returns whether graphs are now shown."""
        self.graphs_shown = not self.graphs_shown
        self.query_one("#gpu-rows").display = not self.graphs_shown
        self.query_one(HardwareGraphs).display = self.graphs_shown
        if self.graphs_shown and self._now is not None:
            self.query_one(HardwareGraphs).draw(self.history, self._now)
        return self.graphs_shown

    def update_sample(
        self, sample, joules_per_token: float | None, window_joules_per_token: float | None = None
    ) -> None:
        """Show one telemetry Sample; the J/token figures are None when they cannot be measured
        (over the last minute, and over the history window)."""
        self.history.add(sample)
        self._now = sample.t
        gpus = [gpu_line(g) for g in sample.gpus] or ["no GPU telemetry (amdsmi / NVML not found): n/a"]
        self.query_one("#gpu-rows", Static).update("\n".join(gpus))
        if self.graphs_shown:
            self.query_one(HardwareGraphs).draw(self.history, sample.t)
        ram = used_total(sample.ram_used_bytes, sample.ram_total_bytes)
        total, gpu_w, cpu_w = node_power(sample)
        minutes = f"{self.history.window_s / 60:.0f} min"
        avg = self.history.average_node_power()
        lines = [
            f"CPU  util {pct(sample.cpu_util_pct)}  package {num(sample.cpu_power_w, '.0f', 'W')}  RAM {ram}",
            f"node {num(total, '.0f', 'W')} (GPUs {num(gpu_w, '.0f')} + CPU {num(cpu_w, '.0f')})  "
            f"{minutes} avg {num(avg, '.0f', 'W')}",
            f"energy/output token (60 s)  {num(joules_per_token, '.3g', 'J')}",
            energy_line(minutes, window_joules_per_token),
        ]
        self.query_one("#host-rows", Static).update("\n".join(lines))
