"""Pilot tests of the benchmark screen on the real demo checkpoint: a tiny run, a sweep with its
frontier, cancel (the chat answers afterwards), preset clipping, saved runs compared."""

from __future__ import annotations

import asyncio
import json

import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.paths import bench_runs_dir
from kimitui.tui.app import KimiApp
from kimitui.tui.benchmark.setup import clip_lengths, config_from_form, default_form, preset, preset_form
from kimitui.tui.benchmark.store import list_runs
from kimitui.tui.screens.benchmark import BenchmarkScreen
from kimitui.tui.widgets.bench.form import BenchForm
from kimitui.tui.widgets.bench.frontier import FrontierPanel, char_plot
from kimitui.tui.widgets.bench.saved import SavedRuns
from kimitui.tui.widgets.bench.tables import ComparisonTable, ResultTable
from kimitui.tui.widgets.chat.prompt import PromptInput
from tests.kimitui.tui_fakes import FakeSampler, SharedLLM, local_app, open_screen, sample, screen_text, wait_for

ARGS = EngineArgs(max_model_len=1024, kv_cache_tokens=4096, device="cpu", max_num_seqs=4)
SIZE = (180, 50)
TINY = {
    "input_len": "32",
    "output_len": "8",
    "num_prompts": "4",
    "max_concurrency": "2",
    "sweep": "",
    "num_warmups": "0",
    "temperature": "0",
    "label": "",
}


@pytest.fixture(scope="module")
def llm():
    engine = AsyncLLM(engine_args=ARGS)
    yield SharedLLM(engine)
    engine.shutdown()


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def make_app(llm) -> KimiApp:
    return local_app(ARGS, llm)


async def open_bench(app, pilot) -> BenchmarkScreen:
    return await open_screen(app, pilot, "f5", BenchmarkScreen)


async def run_form(pilot, screen: BenchmarkScreen, values: dict[str, str], timeout: float = 30) -> None:
    screen.query_one(BenchForm).set_values(values)
    saved_before = screen.runs_finished
    await pilot.press("ctrl+r")
    assert str(screen.query_one("#bench-form-error").render()) == ""
    await wait_for(pilot, lambda: screen.runs_finished > saved_before, timeout=timeout)
    await pilot.pause(0.1)


def run(coro):
    return asyncio.run(coro)


def test_tiny_run_shows_results_and_is_saved(llm, data_home):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            await run_form(pilot, screen, {**TINY, "label": "tiny"})
            assert "4/4 requests" in str(screen.query_one("#bench-counts").render())
            assert "finished" in str(screen.query_one("#bench-status").render())
            table = screen.query_one(ResultTable).cell_text()
            for metric in (
                "mean TTFT (ms)",
                "P99 TPOT (ms)",
                "median E2EL (ms)",
                "output throughput",
                "tput per GPU",
                "tokens per kWh",
                "$/1M tokens, hyperscaler",
            ):
                assert metric in table
            assert "successful requests  4" in table
            assert "n/a" in table  # no telemetry sampler: power and energy are n/a, not invented
            runs = list_runs()
            assert len(runs) == 1 and runs[0].result["completed"] == 4
            assert runs[0].path.parent == bench_runs_dir() == data_home / "data" / "kimitui" / "bench"
            saved = json.loads(runs[0].path.read_text())
            assert saved["total_output_tokens"] == 32 and saved["label"] == "tiny"
            assert "tiny" in screen_saved_text(screen)

    run(scenario())


def screen_saved_text(screen) -> str:
    saved = screen.query_one(SavedRuns)
    return "\n".join(r.title for r in saved.runs)


def test_sweep_shows_frontier(llm):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            await run_form(pilot, screen, {**TINY, "sweep": "1,2"}, timeout=60)
            panel = screen.query_one(FrontierPanel)
            assert panel.sweep is not None and len(panel.sweep["points"]) == 2
            assert panel.sweep["frontier"]
            text = str(panel.query_one("#bench-frontier-text").render())
            # the engine on the CPU has no GPU: the frontier is the host's tok/s
            per = "host" if str(llm.engine.device).startswith("cpu") else "GPU"
            assert "Throughput vs interactivity frontier" in text and f"tok/s/{per}" in text
            assert all(p["num_gpus"] == (0 if per == "host" else 1) for p in panel.sweep["points"])
            assert screen.query_one("#bench-tabs").active == "tab-frontier"
            assert "Frontier" in screen_text(app)
            assert len(list_runs()) == 2  # each sweep point is a saved run
            assert "c1" in screen.query_one(ResultTable).cell_text()

    run(scenario())


def test_cancel_mid_run_then_chat_answers(llm):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            screen.query_one(BenchForm).set_values({**TINY, "output_len": "400", "num_prompts": "8"})
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: llm.stats().num_running > 0)
            await pilot.press("ctrl+x")
            await wait_for(pilot, lambda: not screen.running, timeout=30)
            await pilot.pause(0.1)
            assert "cancelled" in str(screen.query_one("#bench-status").render())
            assert list_runs() == []  # a cancelled run is not a finished run
            # Warm-ups do not watch the cancel event: Cancel must still stop them at once.
            screen.query_one(BenchForm).set_values({**TINY, "output_len": "400", "num_warmups": "4"})
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: llm.stats().num_running > 0)
            await pilot.press("ctrl+x")
            await wait_for(pilot, lambda: not screen.running, timeout=10)
            assert list_runs() == []
            await wait_for(pilot, lambda: llm.stats().num_running == 0 and llm.stats().num_waiting == 0, timeout=10)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen.id == "main")
            await pilot.pause(0.05)
            app.screen.query_one(PromptInput).focus()
            await pilot.press(*"hello", "enter")
            await wait_for(pilot, lambda: app.bridge.reply is not None and app.bridge.reply.done)
            assert app.bridge.reply.num_tokens == 8

    run(scenario())


def test_preset_clipping_note(llm):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            screen.query_one("#bench-preset").value = "seed-128k100"
            await pilot.pause(0.1)
            note = str(screen.query_one("#bench-clip-note").render())
            assert "max_model_len=1,024" in note and "input 131,072 -> 924" in note
            values = screen.query_one(BenchForm).values()
            assert (values["input_len"], values["output_len"], values["num_prompts"]) == ("924", "100", "64")
            assert "max_model_len=1,024" in screen_text(app)
            screen.query_one("#bench-preset").value = "quick"
            await pilot.pause(0.1)
            assert str(screen.query_one("#bench-clip-note").render()).strip() == ""

    run(scenario())


def test_compare_two_saved_runs(llm):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            await run_form(pilot, screen, {**TINY, "label": "first"})
            await run_form(pilot, screen, {**TINY, "label": "second", "max_concurrency": "1"})
            saved = screen.query_one(SavedRuns)
            assert len(saved.runs) == 2
            saved.select(*(str(r.path) for r in saved.runs))
            await pilot.pause(0.1)
            table = screen.query_one(ComparisonTable)
            header = table.cell_text().splitlines()[0]
            assert "first c2" in header and "second c1" in header
            assert len(table.columns) == 3

    run(scenario())


# -- setup logic without the app ------------------------------------------------------------
def test_clip_lengths():
    assert clip_lengths(1024, 1024, 0.0, 2048) == (1024, 1024, None)
    inp, out, note = clip_lengths(8192, 1024, 0.0, 2048)
    assert (inp, out) == (1024, 1024) and "input 8,192 -> 1,024" in note
    assert clip_lengths(131072, 100, 0.0, 2048)[:2] == (1948, 100)
    assert clip_lengths(8192, 1024, 0.0, None) == (8192, 1024, None)


def test_form_validation_names_the_field():
    form = default_form()
    form.update(preset_form(preset("ix-1k1k"), 4096)[0])
    config = config_from_form(form, max_model_len=4096)
    shape = (config.random_input_len, config.num_prompts, config.max_concurrency, config.num_warmups)
    assert shape == (1024, 160, 16, 32)
    assert config.percentile_metrics == ("ttft", "tpot", "itl", "e2el")
    with pytest.raises(ValueError, match="num prompts"):
        config_from_form({**form, "num_prompts": "many"}, max_model_len=4096)
    with pytest.raises(ValueError, match="sweep"):
        config_from_form({**form, "sweep": "1,x"}, max_model_len=4096)
    with pytest.raises(ValueError, match="pricing-tier"):
        config_from_form({**form, "pricing_tiers": "cheap"}, max_model_len=4096)
    tiers = config_from_form({**form, "pricing_tiers": "a=1, b=2.5"}, max_model_len=None).pricing_tiers
    assert [(t.name, t.usd_per_gpu_hour) for t in tiers] == [("a", 1.0), ("b", 2.5)]


def test_char_plot_fallback_marks_points_and_front():
    text = char_plot(
        [(10.0, 500.0, "c1"), (5.0, 800.0, "c2"), (4.0, 300.0, "c4")],
        [(5.0, 800.0), (10.0, 500.0)],
        width=40,
        height=10,
    )
    assert "●c1" in text and "●c2" in text and "○c4" in text
    assert "tok/s per GPU" in text and "tok/s per user" in text and "·" in text


def test_live_power_comes_from_the_app_sampler(llm):
    async def scenario():
        app = KimiApp(ARGS, engine_factory=lambda args, progress: llm, sampler=FakeSampler([sample(1000.0, 5000.0)]))
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_bench(app, pilot)
            await pilot.pause(0.6)  # one live poll
            # Three MI355X read 1100 + 1110 + 1120 W; the fourth has no power reading and adds nothing.
            assert "power 3330 W" in str(screen.query_one("#bench-live").render())

    run(scenario())
