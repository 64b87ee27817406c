"""The base of the benchmark (F5) and evaluation (F9) screens: one job at a time on a worker
thread, the same keys and the same Esc on both.

- Ctrl+R (or the Run button) runs; it is greyed while a job runs.
- Ctrl+X (or Cancel) cancels the running job and stays on the screen to show what finished.
- Esc goes back to the chat. While a job runs, the first Esc only warns: a second Esc within
  ``ESC_CONFIRM_S`` cancels the job and goes back. A run can take minutes, so one stray key must
  not throw it away, and leaving never leaves requests or engines running behind the screen.

A subclass names its buttons ``<ID_PREFIX>-run`` / ``<ID_PREFIX>-cancel``, builds its job in
``make_job`` and handles its own ``...Finished`` message by calling ``job_ended`` first.
"""

from __future__ import annotations

import time

from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Button

from kimitui.tui.jobs import Job, JobFinished

ESC_CONFIRM_S = 3.0


class JobScreen(Screen):
    BINDINGS = [
        Binding("escape", "back", "Back to chat"),
        Binding("ctrl+r", "run", "Run"),
        Binding("ctrl+x", "cancel", "Cancel run"),
    ]
    JOB_NAME = "job"  # "benchmark", "evaluation": the worker's name and group, the words of the warning
    ID_PREFIX = "job"  # "bench", "eval": the Run and Cancel buttons' ids

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.job: Job | None = None
        self.runs_finished = 0  # jobs ended (finished, cancelled or failed) since the screen opened
        self._esc_armed_at = float("-inf")

    @property
    def running(self) -> bool:
        return self.job is not None

    # -- what a subclass provides ------------------------------------------------------------
    def make_job(self) -> Job | None:
        """The job the form describes, or None after showing why the form is wrong."""
        raise NotImplementedError

    def show_running(self, running: bool) -> None:
        """Switch the form between running and idle (buttons, inputs)."""

    def show_cancelling(self) -> None:
        """Say that a cancel was asked for (the job posts its end when it has stopped)."""

    # -- shared behaviour --------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "run":
            return None if self.running else True  # shown greyed while a job runs
        if action == "cancel":
            return True if self.running else None
        return True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == f"{self.ID_PREFIX}-run":
            self.action_run()
        elif event.button.id == f"{self.ID_PREFIX}-cancel":
            self.action_cancel()

    def action_run(self) -> None:
        if self.running:
            return
        job = self.make_job()
        if job is None:
            return
        self.job = job
        self._esc_armed_at = float("-inf")
        self.show_running(True)
        self.refresh_bindings()
        self.run_worker(job.run, thread=True, group=self.JOB_NAME, exit_on_error=False, name=self.JOB_NAME)

    def action_cancel(self) -> None:
        if self.job is not None and not self.job.cancel_requested:
            self.job.cancel()
            self.show_cancelling()

    def action_back(self) -> None:
        if self.job is not None:
            now = time.monotonic()
            if now - self._esc_armed_at > ESC_CONFIRM_S:
                self._esc_armed_at = now
                self.notify(
                    f"The {self.JOB_NAME} is running: press Esc again to cancel it and go back.", timeout=ESC_CONFIRM_S
                )
                return
            self.job.cancel()
        self.app.pop_screen()

    def on_unmount(self) -> None:
        if self.job is not None:  # leaving mid-run (app exit): do not leave requests or engines behind
            self.job.cancel()

    def wants_progress(self) -> bool:
        """Progress messages still worth showing (none once a cancel was asked for)."""
        return self.job is not None and not self.job.cancel_requested

    def job_ended(self, msg: JobFinished) -> bool:
        """Back to idle; a failure is shown as a notification. True when there are results to show."""
        self.job = None
        self.runs_finished += 1
        self.show_running(False)
        self.refresh_bindings()
        if msg.error:
            self.notify(msg.error, title=f"{self.JOB_NAME.capitalize()} failed", severity="error")
            return False
        return True
