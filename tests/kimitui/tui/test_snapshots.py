"""Text snapshots of the main screen, the settings modal and the help screen, with fake
telemetry, fixed engine stats and a frozen clock. Accept changes with
KIMITUI_UPDATE_SNAPSHOTS=1 (writes tests/kimitui/snapshots/*.txt and .svg for review)."""

from __future__ import annotations

import asyncio

import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.tui.app import KimiApp
from kimitui.tui.messages import TelemetryUpdated
from kimitui.tui.widgets.chat.prompt import PromptInput
from tests.kimitui.tui_fakes import Clock, FakeSampler, FixedStats, SharedLLM, assert_snapshot, sample, stats, wait_for

# float32 named: what auto picks on a CPU depends on its instruction sets, a snapshot must not
ARGS = EngineArgs(max_model_len=1024, kv_cache_tokens=4096, device="cpu", dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(engine_args=ARGS)
    yield SharedLLM(engine)
    engine.shutdown()


async def frozen_main(app, pilot, clock, source, sampler) -> None:
    await wait_for(pilot, lambda: app.screen.id == "main")
    await pilot.pause(0.1)
    app.screen.query_one(PromptInput).cursor_blink = False
    # One minute later: 6000 more tokens and 4 x 60 kJ more GPU energy -> 40 J per token.
    clock.t = 1060.0
    source.value = stats(decode=96.0, generated=6000)
    app.screen._poll_stats()
    later = sample(1060.0, 65000.0)
    sampler.samples.append(later)
    app.screen.post_message(TelemetryUpdated(later))
    await pilot.pause(0.1)


def snapshot(llm, tmp_path, monkeypatch, name: str, keys: tuple[str, ...] = ()) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    clock = Clock(1000.0)
    source = FixedStats(stats(decode=80.0, generated=0))
    sampler = FakeSampler([sample(1000.0, 5000.0)])

    async def scenario():
        app = KimiApp(ARGS, engine_factory=lambda a, p: llm, sampler=sampler, stats_source=source, clock=clock)
        async with app.run_test(size=(180, 50)) as pilot:
            await frozen_main(app, pilot, clock, source, sampler)
            for key in keys:
                await pilot.press(key)
                await pilot.pause(0.2)
            assert_snapshot(app, name)

    asyncio.run(scenario())


def test_main_screen(llm, tmp_path, monkeypatch):
    snapshot(llm, tmp_path, monkeypatch, "main_screen")


def test_settings_modal(llm, tmp_path, monkeypatch):
    snapshot(llm, tmp_path, monkeypatch, "settings_modal", ("f2",))


def test_help_screen(llm, tmp_path, monkeypatch):
    snapshot(llm, tmp_path, monkeypatch, "help_screen", ("f1",))
