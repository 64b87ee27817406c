"""Dead-worker watchdog: rank 0 learns within a second that a worker died, on a CPU side channel.

Rank 0 spends its time inside collectives (broadcast of the step inputs, the model's all-reduces).
If a worker dies there, NCCL/RCCL keeps waiting on the GPU until the group's timeout (30 minutes
here), and gloo fails only if the dead rank is one it talks to directly. So the signal must not come
from the collective: each worker gets one end of a ``multiprocessing`` pipe, on which a daemon thread
sends a heartbeat every ``interval_s``; rank 0 runs a watchdog thread that waits on those pipes
and on the workers' process sentinels (readable the moment a process exits, however it exits).

When a worker dies, the watchdog (1) records "worker rank N died (exit code X)" and logs it at once,
(2) calls ``on_failure``, which for a ``WorkerGroup`` aborts NCCL communicators and stops the
surviving workers: their sockets close, so whatever collective rank 0 is blocked in fails within
milliseconds and rank 0 raises ``WorkerError`` with the recorded message. A worker whose heartbeats
stop while it still runs (a hung GPU, a deadlock) is only reported (a warning): a long
GIL-holding load can delay beats too, and killing a healthy run on a guess is worse than waiting.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchdogConfig:
    interval_s: float = 0.5  # worker heartbeat period, and the watchdog's polling period
    stale_after_s: float = 60.0  # no heartbeat for this long from a live worker: warn that it seems hung

    def __post_init__(self):
        if not 0 < self.interval_s < self.stale_after_s:
            raise ValueError(
                f"WatchdogConfig: need 0 < interval_s ({self.interval_s}) < stale_after_s ({self.stale_after_s})"
            )


def stop_workers(procs) -> None:
    """Unblock rank 0's pending collective once a worker died: the group cannot recover anyway.

    NCCL/RCCL waits on the GPU for ever, so its communicators are aborted; stopping the surviving
    workers closes their sockets, which fails any gloo operation at once.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    for p in procs:
        if p.exitcode is None:
            p.kill()


class Heartbeat:
    """Worker side: a daemon thread sending a beat on ``conn`` every ``interval_s`` until the process ends."""

    def __init__(self, conn: mpc.Connection, interval_s: float = WatchdogConfig.interval_s):
        self._conn = conn
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kimitui-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._conn.send_bytes(b".")
            except (OSError, EOFError, ValueError):  # rank 0 is gone or closed the pipe: nothing to tell
                return
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval)
        self._conn.close()


class Watchdog:
    """Rank 0 side: watches ``workers`` ({rank: (process, heartbeat connection or None)})."""

    def __init__(
        self, workers: dict, on_failure: Callable[[str], None] | None = None, config: WatchdogConfig = WatchdogConfig()
    ):
        self._workers = dict(workers)
        self._on_failure = on_failure
        self._config = config
        # a worker's clock starts at its first beat: before that it is importing, not hung
        self._last_beat: dict[int, float | None] = {rank: None for rank in self._workers}
        self._warned: set[int] = set()
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kimitui-watchdog", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """The first worker death seen ("worker rank N died (exit code X)"), or None."""
        return self._failure

    def stop(self) -> None:
        """Stop watching (an orderly shutdown is about to make the workers exit)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        waitables = {}
        for rank, (proc, conn) in self._workers.items():
            waitables[proc.sentinel] = ("exit", rank)
            if conn is not None:
                waitables[conn] = ("beat", rank)
        while not self._stop.is_set() and waitables:
            for ready in mpc.wait(list(waitables), timeout=self._config.interval_s):
                kind, rank = waitables[ready]
                if kind == "beat":
                    try:
                        while ready.poll():
                            ready.recv_bytes()
                        self._last_beat[rank] = time.monotonic()
                        continue
                    except (EOFError, OSError):  # the pipe closed: the process is exiting
                        del waitables[ready]
                        proc = self._workers[rank][0]
                        proc.join(timeout=2)
                        if proc.exitcode is None:
                            continue  # closed its end but still runs: the sentinel will tell
                if self._stop.is_set():
                    return
                self._report(rank)
                return
            self._check_stale()

    def _report(self, rank: int) -> None:
        proc = self._workers[rank][0]
        proc.join(timeout=1)
        self._failure = f"tensor-parallel worker rank {rank} died (exit code {proc.exitcode})"
        log.error("%s; stopping the tensor-parallel group", self._failure)
        if self._on_failure is not None:
            try:
                self._on_failure(self._failure)
            except Exception:  # the report above stands; a failing clean-up must not hide it
                log.exception("watchdog: stopping the group after a worker death failed")

    def _check_stale(self) -> None:
        now = time.monotonic()
        for rank, (proc, _) in self._workers.items():
            last = self._last_beat[rank]
            quiet = 0.0 if last is None else now - last
            if quiet > self._config.stale_after_s and rank not in self._warned:
                self._warned.add(rank)
                log.warning(
                    "tensor-parallel worker %d (pid %s) sent no heartbeat for %.0f s: it may be hung",
                    rank,
                    proc.pid,
                    quiet,
                )
