"""Hardware: one row per GPU (power against its cap, utilisation, HBM, temperature), then the
host (CPU %, RAM, CPU package power) and energy per output token over the last minute.
Every missing reading shows "n/a"."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from kimitui.tui.formatting import NA, bar, num, pct, used_total

BAR_WIDTH = 8


def gpu_line(g) -> str:
    frac = g.power_w / g.power_cap_w if g.power_w is not None and g.power_cap_w else None
    cap = f"/{g.power_cap_w:.0f}" if g.power_cap_w else ""
    power = f"{g.power_w:.0f}{cap} W" if g.power_w is not None else f"{NA} W"
    hbm = used_total(g.mem_used_bytes, g.mem_total_bytes, digits=0)
    return (f"GPU{g.index} {bar(frac, BAR_WIDTH)} {power:>10} util {pct(g.util_pct):>4} "
            f"HBM {hbm} {NA if g.temp_c is None else f'{g.temp_c:.0f}°C'}")


class HardwarePanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static("waiting for the first telemetry sample…", id="gpu-rows", markup=False)
        yield Static("", id="host-rows", markup=False)

    def on_mount(self) -> None:
        self.border_title = "hardware"

    def update_sample(self, sample, joules_per_token: float | None) -> None:
        """Show one telemetry Sample; ``joules_per_token`` is None when it cannot be measured."""
        gpus = [gpu_line(g) for g in sample.gpus] or ["no GPU telemetry (amdsmi / NVML not found): n/a"]
        self.query_one("#gpu-rows", Static).update("\n".join(gpus))
        ram = used_total(sample.ram_used_bytes, sample.ram_total_bytes)
        self.query_one("#host-rows", Static).update("\n".join([
            f"CPU  util {pct(sample.cpu_util_pct)}  package {num(sample.cpu_power_w, '.0f', 'W')}  RAM {ram}",
            f"energy/output token (60 s)  {num(joules_per_token, '.3g', 'J')}",
        ]))
