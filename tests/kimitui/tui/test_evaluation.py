"""Pilot tests of the evaluation screen (F9) on the real demo checkpoint: KL and recall run end
to end and show their tables and the per-depth plot; results are saved and reload; a snapshot of
a finished result; bad form input gets one line."""

from __future__ import annotations

import asyncio
import json

import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.paths import eval_results_dir
from kimitui.tui.app import KimiApp
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.evaluation.store import list_results, save_result
from kimitui.tui.screens.evaluation import EvaluationScreen, settings_from_form
from kimitui.tui.widgets.eval_views import bar, kl_table, recall_by_depth, recall_plot
from tests.helpers.http_server import serving
from tests.kimitui.tui_fakes import SharedLLM, assert_snapshot, local_app, open_screen, screen_text, wait_for

ARGS = EngineArgs(max_model_len=1024, kv_cache_tokens=4096, device="cpu", dtype="float32", max_num_seqs=4)
SIZE = (180, 50)


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


async def open_eval(app, pilot) -> EvaluationScreen:
    return await open_screen(app, pilot, "f9", EvaluationScreen)


def test_both_evaluations_run_on_the_demo(llm, monkeypatch):
    seen: list[tuple[str, int, int]] = []
    original = EvaluationScreen.on_eval_progressed

    def spy(self, msg):
        seen.append((msg.kind, msg.done, msg.total))
        original(self, msg)

    monkeypatch.setattr(EvaluationScreen, "on_eval_progressed", spy)

    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_eval(app, pilot)
            screen.set_form("both", context_lengths="256,512", num_prompts="2", prompt_len="32", decode_tokens="4")
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.runs_finished == 1, timeout=120)
            await pilot.pause(0.1)
            msg = screen.last
            assert msg.error is None and not msg.cancelled, msg.error
            kl, rc = msg.results
            assert kl["kind"] == "kl" and rc["kind"] == "recall"
            # KL of the demo's own path (float32 on CPU) against the float32 reference
            assert kl["prefill"]["positions"] == 2 * (32 - 1 - 4)
            assert kl["decode"]["positions"] == 2 * 4
            assert kl["positions"] == 2 * 31
            assert 0.0 <= kl["mean_kl"] < 1e-3 and kl["top1_agreement"] > 0.9
            # recall: both lengths, every default depth; random weights find (next to) nothing
            assert [r["context_length"] for r in rc["results"]] == [256, 512]
            assert rc["total"] == 10
            for r in rc["results"]:
                assert r["prompt_tokens_max"] <= r["context_length"]
            # KL's bar counted its 2 prompts (a pending progress message is replaced by the next one,
            # so the last KL update may give way to recall's first)
            assert any(k == "kl" and t == 2 for k, _, t in seen)
            assert any(k == "recall" for k, _, _ in seen)
            text = screen_text(app)
            assert "KL divergence: demo" in text and "top-1 agreement" in text and "decode" in text
            assert "Long-context recall" in text and "Recall per depth" in text and "depth 0.75" in text
            assert float(screen.query_one("#eval-progress").percentage) == 1.0
            # saved on disk, listed on the screen, and selecting one shows it again
            saved = list_results()
            assert sorted(s.result["kind"] for s in saved) == ["kl", "recall"]
            assert {p.parent for p in msg.saved} == {eval_results_dir()}
            screen.query_one("#eval-kl").update("")
            screen.query_one("#eval-recall").update("")
            options = screen.query_one("#eval-saved-list")
            assert options.option_count == 2
            idx = next(i for i, s in enumerate(screen._saved) if s.result["kind"] == "recall")
            options.highlighted = idx
            options.action_select()
            await pilot.pause(0.1)
            assert "Long-context recall" in screen_text(app)
            # the chat still answers after the run (KL's engines are gone, the chat's is untouched)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen.id == "main")

    asyncio.run(scenario())


KL_CANNED = {
    "kind": "kl",
    "date": "20261202-040000",
    "model": "demo",
    "tested": "demo dtype=bfloat16",
    "reference": "float32 in this process (demo)",
    "positions": 62,
    "mean_kl": 0.0123,
    "median_kl": 0.01,
    "p99_kl": 0.05,
    "max_kl": 0.07,
    "top1_agreement": 0.95,
    "rms_delta_p": 0.02,
    "ppl": 100.0,
    "ppl_base": 99.0,
    "approximate": False,
    "prefill": {
        "positions": 54,
        "mean_kl": 0.012,
        "median_kl": 0.01,
        "p99_kl": 0.05,
        "max_kl": 0.07,
        "top1_agreement": 0.96,
        "rms_delta_p": 0.02,
        "ppl": 100.0,
        "ppl_base": 99.0,
    },
    "decode": {
        "positions": 8,
        "mean_kl": 0.014,
        "median_kl": 0.012,
        "p99_kl": 0.03,
        "max_kl": 0.031,
        "top1_agreement": 0.875,
        "rms_delta_p": 0.025,
        "ppl": 101.0,
        "ppl_base": 99.5,
    },
}


def _recall_canned() -> dict:
    def length(n, found):
        depths = [{"depth": d, "found": f, "total": 1, "recall": float(f)} for d, f in zip((0.0, 0.5, 1.0), found)]
        return {
            "context_length": n,
            "prompt_tokens_min": n - 20,
            "prompt_tokens_max": n - 3,
            "found": sum(found),
            "total": 3,
            "recall": sum(found) / 3,
            "seconds": 1.0,
            "verdicts": {},
            "depths": depths,
            "items": [],
        }

    return {
        "kind": "recall",
        "date": "20261202-040100",
        "model": "demo",
        "target": "demo in-process",
        "context_lengths": [256, 512],
        "depths": [0.0, 0.5, 1.0],
        "found": 3,
        "total": 6,
        "recall": 0.5,
        "results": [length(256, (1, 1, 0)), length(512, (1, 0, 0))],
    }


def test_saved_results_reload_and_snapshot(llm):
    save_result(KL_CANNED)
    save_result(_recall_canned())
    (eval_results_dir() / "junk.json").write_text("{not json")
    (eval_results_dir() / "other.json").write_text(json.dumps({"kind": "bench"}))
    assert [s.result["kind"] for s in list_results()] == ["recall", "kl"]  # newest first, junk skipped

    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_eval(app, pilot)
            options = screen.query_one("#eval-saved-list")
            assert options.option_count == 2
            screen.show_results([s.result for s in screen._saved], ["saved results"])
            await pilot.pause(0.2)
            assert_snapshot(app, "evaluation_screen")

    asyncio.run(scenario())


def test_form_errors_and_views():
    with pytest.raises(ValueError, match="KL prompts"):
        settings_from_form(
            "both", {"context_lengths": "256", "num_prompts": "x", "prompt_len": "8", "decode_tokens": "0"}
        )
    with pytest.raises(ValueError, match="context-lengths"):
        settings_from_form(
            "kl", {"context_lengths": "abc", "num_prompts": "1", "prompt_len": "8", "decode_tokens": "0"}
        )
    with pytest.raises(ValueError, match="evaluation must be"):
        settings_from_form("nope", {})
    s = settings_from_form(
        "recall", {"context_lengths": "1k,2048", "num_prompts": "1", "prompt_len": "8", "decode_tokens": "0"}
    )
    assert s.kinds == ("recall",) and s.context_lengths == (1024, 2048)
    assert bar(0.0, 8) == " " * 8 and bar(1.0, 8) == "█" * 8 and bar(0.5, 8) == "████    "
    assert recall_by_depth(_recall_canned()) == [(0.0, 2, 2), (0.5, 1, 2), (1.0, 0, 2)]
    assert "100.0% (2/2)" in recall_plot(_recall_canned())
    table = kl_table(KL_CANNED)
    assert "95.00%" in table and "87.50%" in table and "0.012300" in table
    with pytest.raises(ValueError, match="kind"):
        save_result({"kind": "bench"})


def test_a_length_above_the_limit_fails_as_one_line(llm):
    async def scenario():
        app = make_app(llm)
        async with app.run_test(size=SIZE) as pilot:
            screen = await open_eval(app, pilot)
            screen.set_form("recall", context_lengths="256,2048")
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: screen.runs_finished == 1, timeout=60)
            await pilot.pause(0.1)
            assert "max_model_len is 1024" in screen.last.error and "\n" not in screen.last.error
            assert "failed: ValueError: context length 2048" in screen_text(app)
            assert list_results() == []
            screen.set_form(num_prompts="0")
            await pilot.press("ctrl+r")
            await pilot.pause(0.1)
            assert screen.runs_finished == 1 and "KL prompts: must be at least 1" in screen_text(app)

    asyncio.run(scenario())


def test_remote_bridge_runs_recall_over_http_and_explains_kl():
    """The TUI attached to a live `kimitui serve` (in a thread): recall goes through the server's chat
    endpoint; KL is not run (it needs the checkpoint in this process) and the screen says so."""
    pytest.importorskip("kimitui.server.app")
    pytest.importorskip("uvicorn")
    from kimitui.tui.bridges.remote import RemoteBridge

    with serving(AsyncLLM(engine_args=ARGS), "demo") as port:

        async def scenario():
            app = KimiApp(
                EngineArgs(),
                generation=GenerationSettings(max_tokens=8, temperature=0.0),
                bridge_factory=lambda a: RemoteBridge(a, f"http://127.0.0.1:{port}/v1", metrics_period_s=0.5),
            )
            async with app.run_test(size=SIZE) as pilot:
                screen = await open_eval(app, pilot)
                screen.set_form("both", context_lengths="256")
                await pilot.press("ctrl+r")
                await wait_for(pilot, lambda: screen.runs_finished == 1, timeout=120)
                await pilot.pause(0.1)
                msg = screen.last
                assert msg.error is None, msg.error
                assert [r["kind"] for r in msg.results] == ["recall"]
                rc = msg.results[0]
                assert "model demo" in rc["target"] and rc["total"] == 5
                assert 200 <= rc["results"][0]["prompt_tokens_max"] <= 256  # the server's own count
                assert len(msg.notes) == 1 and "kimitui eval kl --base-url" in msg.notes[0]
                text = screen_text(app)
                assert "KL is measured in this process" in text and "Recall per depth" in text
                assert [s.result["kind"] for s in list_results()] == ["recall"]

        asyncio.run(scenario())


class _Inbox:
    def __init__(self) -> None:
        self.messages = []

    def post_message(self, msg) -> bool:
        self.messages.append(msg)
        return True


def test_a_cancelled_job_saves_nothing_and_says_so(tmp_path):
    from kimitui.tui.evaluation.job import EvalFinished, EvalJob, EvalSettings

    inbox = _Inbox()
    job = EvalJob(EvalSettings(("kl", "recall")), bridge=None, notify=inbox, save_dir=tmp_path)
    job.cancel()
    job.run()
    (finished,) = inbox.messages
    assert isinstance(finished, EvalFinished) and finished.cancelled and finished.error is None
    assert finished.results == [] and list(tmp_path.iterdir()) == []
