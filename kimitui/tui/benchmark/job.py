"""One benchmark run (or sweep) against the app's bridge (loaded engine or remote server), off the
UI thread.

The job runs kimitui.bench's ``run_benchmark`` / ``run_sweep`` on a worker thread with its own
event loop: prompt building (a decode/re-encode round trip per prompt, like vLLM) and metric
math then never stall a key press. AsyncLLM serves streams from any loop, so the chat and the
benchmark share the one engine; a remote server gets its own HTTP client on the job's loop. Progress travels as coalescing messages; Cancel sets the
benchmark's cancel event on the job's loop, which aborts the requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from textual.message_pump import MessagePump

from kimitui.bench.runner import BenchmarkConfig, run_benchmark, sweep_summary
from kimitui.tui.benchmark.store import save_run
from kimitui.tui.jobs import JobFinished, JobProgressed

log = logging.getLogger(__name__)


@dataclass
class BenchProgressed(JobProgressed):
    """``phase`` is "preparing" (prompts, warm-ups) or "running"; ``point`` counts sweep points from 1."""

    phase: str
    done: int
    total: int
    elapsed_s: float
    point: int
    num_points: int


@dataclass
class BenchFinished(JobFinished):
    """The run ended (tui/jobs.py): ``results`` holds one result per point (one for a single run),
    ``saved`` the files written (cancelled points are not saved); ``sweep`` the sweep summary
    (frontier, ladder) or None."""

    sweep: dict[str, Any] | None = None


class BenchJob:
    def __init__(
        self, config: BenchmarkConfig, source: Any, sampler: Any, notify: MessagePump, save_dir: Path | None = None
    ) -> None:
        """``source``: a bridges.base.BenchSource (tokenizer, model name, client factory)."""
        self.config = config
        self.source = source
        self.model_name = source.model_name
        self.sampler = sampler
        self.notify = notify
        self.save_dir = save_dir
        self.num_points = len(config.sweep_concurrency) or 1
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancel: asyncio.Event | None = None
        self._task: asyncio.Future | None = None
        self._cancel_requested = False
        self._dispatching = False
        self._point = 0
        self._results: list[dict[str, Any]] = []

    def cancel(self) -> None:
        """Thread-safe: stop issuing requests and abort those in flight."""
        with self._lock:
            self._cancel_requested = True
            if self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_cancel)
                except RuntimeError:  # the loop already closed: the run is over anyway
                    pass

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def run(self) -> None:
        """Run to the end on the calling (worker) thread; always posts one BenchFinished."""
        loop = asyncio.new_event_loop()
        try:
            finished = loop.run_until_complete(self._main(loop))
        except Exception as e:  # noqa: BLE001 - shown on the screen; the traceback goes to the log
            log.exception("benchmark failed")
            finished = BenchFinished(cancelled=self._cancel_requested, error=f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._loop = None
            loop.close()
        self.notify.post_message(finished)

    def _on_cancel(self) -> None:
        # In the timed window the cancel event ends the point with the requests that finished.
        # Prompt building and warm-ups do not watch that event, so there the task itself is
        # cancelled: the client's CancelledError path aborts the warm-up requests.
        self._cancel.set()
        if not self._dispatching and self._task is not None:
            self._task.cancel()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> BenchFinished:
        self._cancel = asyncio.Event()
        self._task = asyncio.ensure_future(self._points())
        with self._lock:
            self._loop = loop
            if self._cancel_requested:
                self._on_cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        results = self._results
        sweep = sweep_summary(results, self.config, self._cancel.is_set()) if self.config.sweep_concurrency else None
        saved = [save_run(r, self.save_dir) for r in results if not r.get("cancelled")]
        return BenchFinished(results=results, saved=saved, cancelled=self._cancel.is_set(), sweep=sweep)

    async def _points(self) -> None:
        cfg = self.config
        self.tokenizer = self.source.resolve_tokenizer()
        client = self.source.make_client(cfg)
        try:
            await self._run_points(client)
        finally:
            await client.aclose()

    async def _run_points(self, client: Any) -> None:
        cfg = self.config
        # One run_benchmark per sweep level, as run_sweep does, but kept here so the points
        # finished before a cancel survive (run_sweep only returns at the end).
        levels = cfg.sweep_concurrency or (cfg.max_concurrency,)
        for c in levels:
            if self._cancel.is_set():
                break
            self._point += 1
            self._dispatching = False
            self._post("preparing", 0, cfg.num_prompts, 0.0)
            point_cfg = replace(cfg, max_concurrency=c, sweep_concurrency=())
            self._results.append(
                await run_benchmark(point_cfg, client, self.tokenizer, self.sampler, self._progress, self._cancel)
            )
            self._dispatching = False

    def _progress(self, done: int, total: int, elapsed_s: float) -> None:
        self._dispatching = True  # run_benchmark reports 0 done once its warm-ups are over
        self._post("running", done, total, elapsed_s)

    def _post(self, phase: str, done: int, total: int, elapsed_s: float) -> None:
        self.notify.post_message(BenchProgressed(phase, done, total, elapsed_s, max(1, self._point), self.num_points))
