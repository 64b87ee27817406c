"""The job-screen base shared by the benchmark (F5) and evaluation (F9) screens: one set of keys
and one Esc behaviour (a first Esc while a job runs only warns; a second cancels and goes back),
checked on a small screen with a fake job, and the help screen says so."""

from __future__ import annotations

import asyncio
import threading

from textual.app import App
from textual.widgets import Button

from kimitui.tui.jobs import JobFinished, JobProgressed
from kimitui.tui.screens.benchmark import BenchmarkScreen
from kimitui.tui.screens.evaluation import EvaluationScreen
from kimitui.tui.screens.help import KEYS
from kimitui.tui.screens.job import ESC_CONFIRM_S, JobScreen
from tests.kimitui.tui_fakes import wait_for


class FakeFinished(JobFinished):
    pass


class FakeProgressed(JobProgressed):
    pass


class FakeJob:
    """Runs until cancelled (or released), then posts one FakeFinished."""

    def __init__(self, notify):
        self.notify = notify
        self._cancel = threading.Event()
        self.release = threading.Event()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> None:
        while not (self._cancel.is_set() or self.release.is_set()):
            self._cancel.wait(0.01)
        self.notify.post_message(FakeFinished(results=[{"n": 1}], cancelled=self._cancel.is_set()))


class FakeScreen(JobScreen):
    JOB_NAME, ID_PREFIX = "fake job", "fake"

    def __init__(self):
        super().__init__(id="fake")
        self.jobs: list[FakeJob] = []
        self.ended: list[FakeFinished] = []
        self.cancelling = 0

    def compose(self):
        yield Button("Run", id="fake-run")
        yield Button("Cancel", id="fake-cancel")

    def make_job(self):
        self.jobs.append(FakeJob(self))
        return self.jobs[-1]

    def show_cancelling(self) -> None:
        self.cancelling += 1

    def on_fake_finished(self, msg: FakeFinished) -> None:
        if self.job_ended(msg):
            self.ended.append(msg)


class Host(App):
    def on_mount(self) -> None:
        self.push_screen(FakeScreen())


def test_esc_while_a_job_runs_asks_once_then_cancels_and_goes_back():
    async def scenario():
        app = Host()
        async with app.run_test() as pilot:
            screen = app.screen
            assert isinstance(screen, FakeScreen)
            assert screen.check_action("cancel", ()) is None and screen.check_action("run", ()) is True
            await pilot.press("ctrl+r")
            assert screen.running and screen.check_action("run", ()) is None
            await pilot.press("escape")  # the first Esc only warns
            await pilot.pause(0.05)
            assert app.screen is screen and screen.running and not screen.jobs[0].cancel_requested
            await pilot.press("escape")  # the second, within ESC_CONFIRM_S: cancel and leave
            await wait_for(pilot, lambda: app.screen is not screen)
            assert screen.jobs[0].cancel_requested

    asyncio.run(scenario())


def test_ctrl_x_cancels_and_stays_and_a_finished_job_leaves_at_once():
    async def scenario():
        app = Host()
        async with app.run_test() as pilot:
            screen = app.screen
            await pilot.click("#fake-run")
            await wait_for(pilot, lambda: screen.running)
            await pilot.press("ctrl+x")
            await wait_for(pilot, lambda: not screen.running)
            assert app.screen is screen and screen.cancelling == 1 and screen.runs_finished == 1
            assert screen.ended[-1].cancelled
            await pilot.press("ctrl+r")
            screen.jobs[-1].release.set()  # finishes on its own
            await wait_for(pilot, lambda: not screen.running)
            assert not screen.ended[-1].cancelled and screen.runs_finished == 2
            await pilot.press("escape")  # nothing runs: Esc goes back at once
            await wait_for(pilot, lambda: app.screen is not screen)

    asyncio.run(scenario())


def test_progress_messages_replace_older_ones_of_their_kind_only():
    assert FakeProgressed().can_replace(FakeProgressed())
    assert not FakeProgressed().can_replace(JobProgressed())


def test_both_job_screens_share_the_keys_and_the_esc_behaviour_and_help_says_it():
    for cls in (BenchmarkScreen, EvaluationScreen):
        assert issubclass(cls, JobScreen)
        for name in ("action_back", "action_run", "action_cancel", "check_action", "on_button_pressed"):
            assert getattr(cls, name) is getattr(JobScreen, name), (cls, name)
    esc = [what for key, what in KEYS if key.strip() == "Esc" and "F5" in what]
    assert esc and f"second Esc within {ESC_CONFIRM_S:g} s cancels it" in esc[0]
