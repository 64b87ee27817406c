"""One process per device over torch.distributed: rank 0 is the engine process (scheduler,
tokenizer, sampling); ranks 1..N-1 are spawned workers that mirror every model step.

Workers receive each step's ``StepInputs`` (plain Python, pickled) on a pipe from rank 0 and run the
same forward pass, so the model's all-reduces and all-gathers pair up. The pipe, not a collective,
is where an idle worker waits, because a wait there has no deadline: a server with no requests for
hours must still answer the next one. A collective fails after the process group's timeout
(``KIMITUI_DIST_TIMEOUT_S``, default 1800 s), so a worker parked in a broadcast for the next step
(as this module once did) died after 30 idle minutes and took the group with it. Only real
collectives, entered by every rank within one step of each other, are bounded by that timeout. A
keep-alive from rank 0 would also work, but it needs a thread of its own racing the engine's sends
and wakes every rank all the time; the pipe costs nothing while idle, carries the inputs host to
host (never through NCCL, so no rank waits on a device to learn a step's size), and ends with EOF
when rank 0 goes away, so orphaned workers exit at once instead of hanging in a collective.

A worker that dies surfaces in rank 0 as a ``WorkerError``, never as a hang: rank 0's watchdog sees
the death on a pipe within a second and stops the group, which fails the pending collective
(``engine/parallel/watchdog.py``); a send to its closed pipe fails at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimitui.engine.parallel.state import ParallelState
from kimitui.engine.parallel.watchdog import Watchdog, stop_workers

log = logging.getLogger(__name__)

ENV_DIST_TIMEOUT = "KIMITUI_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 1800.0
# The rendezvous waits for every worker to import torch and connect; a worker that dies meanwhile is
# caught by rank 0's watchdog, so this only bounds a start-up that hangs.
_STARTUP_TIMEOUT_S = 1800.0


def dist_timeout_s(env=None) -> float:
    """Seconds one collective may wait for its peers (``KIMITUI_DIST_TIMEOUT_S``, default 1800).

    It bounds the model's all-reduces and all-gathers, which every rank enters within one step of
    the others, never a worker's wait for work (see the module docstring)."""
    raw = (os.environ if env is None else env).get(ENV_DIST_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_DIST_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_DIST_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{ENV_DIST_TIMEOUT}={raw!r}: the timeout must be a positive number of seconds")
    return seconds


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died."""


@dataclass(frozen=True)
class WorkerSpec:
    model_dir: str
    world_size: int
    port: int
    device_type: str  # "cpu" or "cuda"
    dtype: str  # torch dtype name, e.g. "float32"
    max_model_len: int
    block_size: int
    expert_placement: list[list[int]] | None
    threads_per_rank: int
    dist_timeout_s: float | None = None  # None: KIMITUI_DIST_TIMEOUT_S as rank 0 reads it (WorkerGroup sets it)
    device_base: int = 0  # rank r runs on GPU device_base + r (rank_device)
    decode_graphs: bool | None = False  # rank 0's ModelRunner argument: every rank must take the same path
    capture_graphs: bool = True  # capture every decode graph bucket after ready, as rank 0 does


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int, base: int = 0) -> torch.device:
    """Rank ``rank``'s device: GPU ``base + rank`` (``base``: the index ``--device`` named, checked
    against the visible GPUs by ``EngineArgs.resolve_device``), or the CPU."""
    return torch.device("cuda", base + rank) if device_type == "cuda" else torch.device("cpu")


def init_rank(spec: WorkerSpec, rank: int) -> ParallelState:
    """Join the process group: NCCL (RCCL on ROCm) between GPUs, gloo on the CPU.

    The rendezvous store gets the generous start-up timeout (workers import torch and connect at
    their own pace); the group's collectives get ``spec.dist_timeout_s``."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    timeout = spec.dist_timeout_s or dist_timeout_s()
    store = dist.TCPStore(
        "127.0.0.1",
        spec.port,
        spec.world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=max(timeout, _STARTUP_TIMEOUT_S)),
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=spec.world_size, timeout=timedelta(seconds=timeout)
    )
    return ParallelState(rank=rank, world_size=spec.world_size, group=dist.group.WORLD)


def next_message(conn):
    """A worker's wait for rank 0's next message: blocks without a deadline. Raises EOFError once
    rank 0 has closed its end (shut down or died)."""
    return pickle.loads(conn.recv_bytes())


class WorkerGroup:
    """Ranks 1..N-1 as child processes, and rank 0's handle on them."""

    def __init__(self, spec: WorkerSpec, target):
        """``target(rank, spec, heartbeat, work)``: a worker's main (engine/runner/worker.py)."""
        if spec.dist_timeout_s is None:  # read once here, so every rank uses rank 0's value
            spec = dataclasses.replace(spec, dist_timeout_s=dist_timeout_s())
        self.spec = spec
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, spec.world_size)]  # heartbeats: (rank 0's end, the worker's)
        work = [ctx.Pipe(duplex=False) for _ in range(1, spec.world_size)]  # step inputs: (the worker's end, rank 0's)
        self.procs = [
            ctx.Process(target=target, args=(r, spec, send, recv), name=f"kimitui-rank{r}", daemon=True)
            for r, (_, send), (recv, _) in zip(range(1, spec.world_size), pipes, work)
        ]
        for p, (_, send), (recv, _) in zip(self.procs, pipes, work):
            p.start()
            send.close()  # the worker holds its end; rank 0 then reads EOF when it dies
            recv.close()  # and the worker alone reads its inputs
        self._work = [send for _, send in work]
        self._closed = False
        self.watchdog = Watchdog(
            {r: (p, recv) for r, (p, (recv, _)) in enumerate(zip(self.procs, pipes), start=1)},
            on_failure=lambda _: stop_workers(self.procs),
        )  # unblocks rank 0

    def join_as_rank0(self) -> ParallelState:
        """Join the process group as rank 0, failing fast if a worker dies before it connects."""
        box = self._while_workers_live(lambda: init_rank(self.spec, 0), "kimitui-rendezvous")
        if "error" in box:
            raise WorkerError(f"could not form the tensor-parallel group: {box['error']}")
        return box["result"]

    def wait_ready(self, par: ParallelState, device: torch.device) -> None:
        """Return once every worker has loaded its shard and allocated its cache (``ready`` on each
        rank is one all-reduce), failing fast if one dies first: otherwise a worker that fails after
        the rendezvous (a bad dtype, no memory for its cache) is noticed only at the first step."""
        box = self._while_workers_live(lambda: par.all_reduce(torch.zeros(1, device=device)), "kimitui-ready")
        if "error" in box:
            raise WorkerError(f"tensor-parallel start-up failed: {box['error']}")

    def _while_workers_live(self, fn, name: str) -> dict:
        """Run ``fn`` on a thread (it blocks on the workers), raising WorkerError as soon as one dies."""
        box: dict = {}

        def call():
            try:
                box["result"] = fn()
            except BaseException as e:  # reported by the caller
                box["error"] = e

        t = threading.Thread(target=call, name=name, daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            failure = self._start_up_failure()
            if failure is not None:
                raise failure
        if "error" in box:
            # a worker that died broke the collective (gloo: "connection reset"): name the worker, which
            # the collective's own error does not, once its exit is seen
            failure = self._start_up_failure(wait_s=2.0)
            if failure is not None:
                raise failure
        return box

    def _start_up_failure(self, wait_s: float = 0.0) -> WorkerError | None:
        """The watchdog's failure or the first worker that exited, as a WorkerError; None if there is
        none after waiting up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.watchdog.failure:
                return WorkerError(f"{self.watchdog.failure} during start-up (see its traceback above)")
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    return WorkerError(
                        f"tensor-parallel worker rank {rank} exited with code {p.exitcode} "
                        "during start-up (see its traceback above)"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def broadcast(self, obj) -> None:
        """Send ``obj`` (a step's inputs) to every worker; it returns once the bytes are in the pipes."""
        self.check()
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._work:
                conn.send_bytes(payload)
        except (OSError, ValueError) as e:  # a worker's end is closed: it died
            raise WorkerError(self._failure(e)) from None

    def check(self) -> None:
        if self.watchdog.failure:
            raise WorkerError(self.watchdog.failure)
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}")

    def _failure(self, error: Exception, wait_s: float = 10.0) -> str:
        # A collective failed: a peer is usually dying. Give the watchdog (or the process table) a
        # few seconds to name it, since a loaded machine can take that long to reap a crashed worker.
        deadline = time.monotonic() + wait_s
        while True:
            if self.watchdog.failure:
                return f"{self.watchdog.failure} ({error})"
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    return f"tensor-parallel worker rank {rank} exited with code {p.exitcode} ({error})"
            if time.monotonic() >= deadline:
                return f"tensor-parallel step failed: {error}"
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.watchdog.stop()  # workers are about to exit on purpose
        for conn in self._work:
            conn.close()  # a worker reads EOF and exits; closing never blocks, even on a hung one
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
