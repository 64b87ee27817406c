"""Test doubles for the TUI tests: a shared demo engine, a scripted telemetry sampler, a fixed
engine-stats source, a settable clock, and text snapshots of the screen."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

from rich.console import Console

from kimitui.engine.metrics import EngineStats
from kimitui.telemetry import GpuSample, Sample

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("KIMITUI_UPDATE_SNAPSHOTS") == "1"


class SharedLLM:
    """Hands one loaded AsyncLLM to many apps; an app's shutdown must not stop it."""

    def __init__(self, llm) -> None:
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        pass


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def stats(decode: float = 0.0, generated: int = 0, **kw) -> EngineStats:
    base = dict(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.25,
        prefix_cache_hit_rate=0.5,
        prefill_tokens_per_s=1234.5,
        decode_tokens_per_s=decode,
        num_preemptions=0,
        kv_cache_capacity_tokens=4096,
        total_prompt_tokens=100,
        total_generation_tokens=generated,
        num_finished=3,
    )
    return EngineStats(**{**base, **kw})


class FixedStats:
    def __init__(self, value: EngineStats) -> None:
        self.value = value

    def __call__(self) -> EngineStats:
        return self.value


def mi355x(index: int, power: float | None, energy: float | None) -> GpuSample:
    return GpuSample(
        index,
        "AMD Instinct MI355X",
        "amd",
        power_w=power,
        power_cap_w=1400.0,
        energy_j=energy,
        util_pct=None if power is None else 87.0,
        mem_used_bytes=200 * 2**30,
        mem_total_bytes=288 * 2**30,
        temp_c=None if power is None else 71.0,
    )


def sample(t: float, energy: float) -> Sample:
    """Four MI355X (GPU3 has an energy counter but no power reading) and a host without RAPL."""
    gpus = tuple(mi355x(i, 1100.0 + 10 * i, energy + i) for i in range(3)) + (mi355x(3, None, energy),)
    return Sample(
        t=t,
        wall=1.7e9 + t,
        gpus=gpus,
        cpu_power_w=None,
        cpu_energy_j=None,
        cpu_util_pct=42.0,
        ram_used_bytes=512 * 2**30,
        ram_total_bytes=1536 * 2**30,
    )


class FakeSampler:
    """The TelemetrySampler surface the app uses; the test decides what it has "read"."""

    def __init__(self, samples: list[Sample] = ()) -> None:
        self.samples = list(samples)
        self.callbacks = []
        self.started = self.stopped = False

    def start(self):
        self.started = True
        return self

    def stop(self) -> None:
        self.stopped = True

    def subscribe(self, callback):
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def latest(self):
        return self.samples[-1] if self.samples else None

    def history(self, since_t=None):
        return [s for s in self.samples if since_t is None or s.t >= since_t]

    def backend_status(self):
        return []

    def emit(self, s: Sample) -> None:
        self.samples.append(s)
        for cb in list(self.callbacks):
            cb(s)


async def wait_for(pilot, predicate, timeout: float = 20.0, step: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await pilot.pause(step)


def screen_text(app) -> str:
    """The screen as plain text: what a user reads, without colors (stable across themes)."""
    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()) + "\n"


def assert_snapshot(app, name: str) -> None:
    text = screen_text(app)
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        app.save_screenshot(f"{name}.svg", path=str(SNAPSHOTS))  # for people reviewing the change
        if not UPDATE:
            raise AssertionError(f"new snapshot {path} written; check it and commit it")
        return
    expected = path.read_text(encoding="utf-8")
    actual = SNAPSHOTS / f"{name}.actual.txt"
    if text != expected:
        actual.write_text(text, encoding="utf-8")
    else:
        actual.unlink(missing_ok=True)
    assert text == expected, f"screen differs from {path}; see {name}.actual.txt (KIMITUI_UPDATE_SNAPSHOTS=1 accepts)"


def local_app(args, llm):
    """The TUI on a shared in-process engine ``llm`` (a ``SharedLLM``), short greedy replies."""
    from kimitui.tui.app import KimiApp
    from kimitui.tui.chat.generation import GenerationSettings

    return KimiApp(
        args, engine_factory=lambda a, progress: llm, generation=GenerationSettings(max_tokens=8, temperature=0.0)
    )


async def open_screen(app, pilot, key: str, screen_cls):
    """From the main screen, press ``key`` and wait for a ``screen_cls`` screen; returns it."""
    await wait_for(pilot, lambda: app.screen.id == "main")
    await pilot.pause(0.05)
    await pilot.press(key)
    await wait_for(pilot, lambda: isinstance(app.screen, screen_cls))
    await pilot.pause(0.05)
    return app.screen
