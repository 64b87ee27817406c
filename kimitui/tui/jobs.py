"""What the benchmark and evaluation jobs share: the pair of messages a job posts to its screen.

A job runs on a worker thread, posts any number of ``JobProgressed`` messages (a newer one
replaces an older one of its kind still queued, so a slow screen only sees the newest) and
exactly one ``JobFinished``. Each job subclasses both (``BenchProgressed``/``BenchFinished``,
``EvalProgressed``/``EvalFinished``) for its own fields; the screen side is
``screens/job.py``'s ``JobScreen``. No engine or HTTP here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from textual.message import Message


@dataclass
class JobProgressed(Message):
    """A job's progress; subclasses add what their screen shows."""

    def can_replace(self, message: Message) -> bool:
        return type(message) is type(self)


@dataclass
class JobFinished(Message):
    """The job ended: ``results`` holds what finished (JSON-able dicts), ``saved`` the files written,
    ``cancelled`` whether the user stopped it, ``error`` one line when it failed."""

    results: list[dict[str, Any]] = field(default_factory=list)
    saved: list[Path] = field(default_factory=list)
    cancelled: bool = False
    error: str | None = None


class Job(Protocol):
    """What ``JobScreen`` needs of a job."""

    @property
    def cancel_requested(self) -> bool: ...

    def cancel(self) -> None:
        """Thread-safe; the job still posts its ``JobFinished``."""

    def run(self) -> None:
        """Run to the end on the calling (worker) thread; posts exactly one ``JobFinished``."""
