"""Hardware history: bounded rings (memory flat after 100,000 samples), node totals, and the
history graphs drawn in the hardware panel (text snapshot, F8 toggles)."""

from __future__ import annotations

import asyncio
import tracemalloc

from textual.app import App, ComposeResult

from kimitui.telemetry import GpuSample, Sample
from kimitui.tui.hardware.history import HardwareHistory, node_power
from kimitui.tui.widgets.hardware.graphs import HardwareGraphs
from kimitui.tui.widgets.hardware.panel import HardwarePanel, energy_line
from tests.kimitui.tui_fakes import assert_snapshot, mi355x, sample


def eight_gpus(t: float) -> Sample:
    phase = int(t) % 60
    gpus = tuple(
        GpuSample(
            i,
            "AMD Instinct MI355X",
            "amd",
            power_w=600.0 + 10 * phase + i,
            power_cap_w=1400.0,
            util_pct=float(phase),
            mem_used_bytes=(100 + phase) * 2**30,
            mem_total_bytes=288 * 2**30,
        )
        for i in range(8)
    )
    return Sample(t=t, wall=1.7e9 + t, gpus=gpus, cpu_power_w=250.0)


def test_rings_stay_bounded_after_100k_samples():
    history = HardwareHistory(window_s=1e9, max_points=600)  # only the length cap can bound this one
    tracemalloc.start()
    try:
        for i in range(20_000):
            history.add(eight_gpus(float(i)))
        mid, _ = tracemalloc.get_traced_memory()
        for i in range(20_000, 100_000):
            history.add(eight_gpus(float(i)))
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(history.node) == 600 and all(len(tr.points) == 600 for tr in history.gpus.values())
    assert len(history) == 9 * 600
    assert end - mid < 64 * 1024, f"history grew by {end - mid} bytes between 20k and 100k samples"
    assert history.node[-1][0] == 99_999.0


def test_age_pruning_and_repeated_samples():
    history = HardwareHistory(window_s=10.0)
    for t in range(100):
        history.add(eight_gpus(float(t)))
        history.add(eight_gpus(float(t)))  # offered twice: recorded once
    assert [t for t, _ in history.node] == [float(t) for t in range(89, 100)]
    assert history.power_caps() == [1400.0]


def test_node_power_adds_what_was_measured_only():
    s = sample(10.0, 5.0)  # GPU3 without a power reading, no CPU package power
    assert node_power(s) == (1100.0 + 1110.0 + 1120.0, 3330.0, None)
    assert node_power(Sample(t=1, wall=1)) == (None, None, None)
    assert energy_line("5 min", 2.0) == "energy (5 min)  2 J/token  1,800,000 tokens/kWh"
    assert energy_line("5 min", None) == "energy (5 min)  n/a/token  n/a tokens/kWh"


class PanelApp(App):
    def compose(self) -> ComposeResult:
        yield HardwarePanel(id="hardware")


def test_history_graphs_snapshot_and_toggle():
    async def scenario():
        app = PanelApp()
        async with app.run_test(size=(64, 52)) as pilot:
            panel = app.query_one(HardwarePanel)
            for t in range(0, 300, 2):  # five minutes of a steady ramp, GPU3 ramping faster
                gpus = tuple(mi355x(i, 400.0 + (t * (3 if i == 3 else 1)) + 20 * i, 0.0) for i in range(4))
                panel.update_sample(Sample(t=1000.0 + t, wall=0.0, gpus=gpus, cpu_power_w=300.0), 1.5, 2.0)
            assert not panel.query_one(HardwareGraphs).display
            assert panel.toggle_graphs() is True
            await pilot.pause(0.2)
            assert panel.query_one(HardwareGraphs).display and not panel.query_one("#gpu-rows").display
            assert_snapshot(app, "hardware_history_graphs")
            assert panel.toggle_graphs() is False
            await pilot.pause(0.05)
            assert panel.query_one("#gpu-rows").display

    asyncio.run(scenario())


def test_throughput_panel_draws_ttft_and_tpot_over_replies():
    from kimitui.tui.formatting import spark
    from kimitui.tui.messages import ReplyFinished
    from kimitui.tui.widgets.throughput_panel import ThroughputPanel

    assert spark([0.0, 0.5, 1.0, None]) == "▁▅█ " and spark([]) == "" and spark([2.0, 2.0]) == "██"

    class Panel(App):
        def compose(self) -> ComposeResult:
            yield ThroughputPanel(id="throughput")

    async def scenario():
        app = Panel()
        async with app.run_test(size=(64, 24)) as pilot:
            panel = app.query_one(ThroughputPanel)
            panel.update_reply(ReplyFinished(1, "", "a", 8, 0.1, 0.01, "stop"))
            await pilot.pause(0.05)
            body = str(panel.query_one("#throughput-body").render())
            assert "trend" not in body  # one reply is no trend yet
            for ttft, tpot in ((0.4, 0.02), (0.2, None)):
                panel.update_reply(ReplyFinished(1, "", "a", 8, ttft, tpot, "stop"))
            await pilot.pause(0.05)
            body = str(panel.query_one("#throughput-body").render())
            assert "TTFT trend ▃█▅  max 400.0 ms" in body and "TPOT trend ▅█   max 20.0 ms" in body  # from 0

    asyncio.run(scenario())
