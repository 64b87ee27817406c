"""The dead-worker watchdog: rank 0 blocked in a collective learns within seconds that a worker died.

The gloo scenario is built so that the collective alone would wait for its whole timeout: rank 0
waits on rank 1, which is alive and silent, while rank 2 is killed. Only the side channel (process
sentinels and heartbeat pipes) can tell rank 0, and stopping the group must unblock it.
"""

import logging
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimitui.engine.parallel.watchdog import Heartbeat, Watchdog, WatchdogConfig, stop_workers
from kimitui.engine.parallel.workers import free_port

FAST = WatchdogConfig(interval_s=0.1, stale_after_s=0.8)


def _toy_rank(rank: int, port: int, heartbeat) -> None:
    # A worker that joins the group, then stays alive without ever answering rank 0.
    Heartbeat(heartbeat, FAST.interval_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    dist.barrier()
    time.sleep(60)


def test_killed_gloo_worker_is_reported_and_unblocks_rank0_within_seconds(caplog):
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_toy_rank, args=(r, port, send), daemon=True) for r, (_, send) in zip((1, 2), pipes)]
    for p, (_, send) in zip(procs, pipes):
        p.start()
        send.close()
    watchdog = Watchdog(
        {r: (p, recv) for r, p, (recv, _) in zip((1, 2), procs, pipes)},
        on_failure=lambda _: stop_workers(procs),
        config=FAST,
    )
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=3, timeout=timedelta(seconds=60)
        )
        dist.barrier()
        assert watchdog.failure is None
        threading.Timer(0.5, os.kill, (procs[1].pid, signal.SIGKILL)).start()  # rank 2 dies mid-run
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="kimitui.engine.parallel.watchdog"):
            with pytest.raises(RuntimeError):
                dist.recv(torch.zeros(1), src=1)  # rank 1 never sends: only the watchdog can end this
        assert time.monotonic() - start < 10
        assert watchdog.failure == f"tensor-parallel worker rank 2 died (exit code {-signal.SIGKILL})"
        assert watchdog.failure in caplog.text  # reported at once, not only when rank 0 next looks
        procs[0].join(timeout=5)
        assert procs[0].exitcode == -signal.SIGKILL  # the surviving worker was stopped with the group
    finally:
        watchdog.stop()
        for p in procs:
            p.kill()
            p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def _fake_worker():
    # A "process" that never exits: a pipe end nobody writes to stands in for its sentinel.
    never, _keep = mp.get_context("spawn").Pipe(duplex=False)
    return SimpleNamespace(sentinel=never, pid=12345, exitcode=None, join=lambda timeout=None: None, _keep=_keep)


def test_silent_live_worker_is_a_warning_not_a_failure(caplog):
    beating_recv, beating_send = mpc.Pipe(duplex=False)
    silent_recv, silent_send = mpc.Pipe(duplex=False)
    silent_send.send_bytes(b".")  # one beat, then silence (a worker that hangs after start-up)
    heartbeat = Heartbeat(beating_send, FAST.interval_s)
    calls = []
    with caplog.at_level(logging.WARNING, logger="kimitui.engine.parallel.watchdog"):
        watchdog = Watchdog(
            {1: (_fake_worker(), beating_recv), 2: (_fake_worker(), silent_recv)}, on_failure=calls.append, config=FAST
        )
        try:
            deadline = time.monotonic() + 5
            while "worker 2" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            watchdog.stop()
            heartbeat.stop()
    assert "tensor-parallel worker 2 (pid 12345) sent no heartbeat" in caplog.text
    assert "worker 1" not in caplog.text  # its beats arrive
    assert watchdog.failure is None and not calls  # a hang is reported, never acted on


def test_config_is_validated():
    with pytest.raises(ValueError, match="interval_s"):
        WatchdogConfig(interval_s=2.0, stale_after_s=1.0)
