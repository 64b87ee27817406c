"""One process per device over torch.distributed: rank 0 is the engine process (scheduler,
tokenizer, sampling); ranks 1..N-1 are spawned workers that mirror every model step.

Workers receive each step's ``StepInputs`` (plain Python) by broadcast over a CPU control channel
and run the same forward pass, so the model's all-reduces and all-gathers pair up. The control
channel is a gloo process group created alongside the model's NCCL (or gloo) group: the
pickled inputs travel host to host, never as tensors through NCCL, so neither side waits on a
device to learn a step's size (``broadcast_object_list`` over NCCL would copy the payload to the
GPU, and the workers would read its length back with ``.item()`` and the bytes with ``.cpu()``). A worker that dies surfaces in rank 0 as a
``WorkerError``, never as a hang: rank 0's watchdog sees the death on a pipe within a second and
stops the group, which fails the pending collective (``engine/parallel/watchdog.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.state import ParallelState
from engine.parallel.watchdog import Heartbeat, Watchdog, stop_workers

log = logging.getLogger(__name__)

# Generous: workers load their shards before the first collective that follows start-up.
_TIMEOUT = timedelta(minutes=30)


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
    decode_graphs: bool | None = False  # rank 0's ModelRunner argument: every rank must take the same path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def init_rank(spec: WorkerSpec, rank: int) -> tuple[ParallelState, object]:
    """Join the process group: NCCL (RCCL on ROCm) between GPUs, gloo on the CPU. Returns the
    model's parallel state and the CPU control group (a gloo group over the same ranks)."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.world_size, timeout=_TIMEOUT)
    # Every rank calls new_group in the same order, as torch.distributed requires. A group of its
    # own on the CPU too: step inputs never interleave with the model's collectives, and the path
    # a GPU run takes is the one CPU tests run.
    control = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    return ParallelState(rank=rank, world_size=spec.world_size, group=dist.group.WORLD), control


def broadcast_object(group, obj=None):
    """Rank 0's ``obj`` on every rank, over the CPU ``group`` (pickled, host memory only)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group, device=torch.device("cpu"))
    return box[0]


def _worker_main(rank: int, spec: WorkerSpec, heartbeat=None) -> None:
    from engine.config import ModelConfig
    from engine.kv_cache.pool import KVCachePool
    from engine.loader import load_model
    from engine.runner import ModelRunner

    if heartbeat is not None:
        Heartbeat(heartbeat)  # rank 0's watchdog hears this process is alive (engine/parallel/watchdog.py)
    try:
        torch.set_num_threads(spec.threads_per_rank)
        device = rank_device(spec.device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        par, control = init_rank(spec, rank)
        config = ModelConfig.from_pretrained(spec.model_dir)
        dtype = getattr(torch, spec.dtype)
        model, _ = load_model(config, spec.model_dir, device, dtype, spec.max_model_len, par=par,
                              expert_placement=spec.expert_placement)
        # Rank 0 sized the pool; every rank allocates the same blocks and state slots (its own
        # share of each layer), since the scheduler's block and slot ids index all of them.
        num_blocks, max_num_seqs, num_snapshots = broadcast_object(control)
        pool = KVCachePool(model.cache_specs(dtype), num_blocks, spec.block_size, max_num_seqs, device,
                           num_snapshots)
        # Same fixed-capacity decode tables and decode graph choice as rank 0: graphed steps pad to
        # the same bucket on every rank, so the collectives inside match.
        runner = ModelRunner(model, pool.caches, spec.block_size, device, max_num_seqs=max_num_seqs,
                             max_model_len=spec.max_model_len, decode_graphs=spec.decode_graphs)
        while True:
            inputs = broadcast_object(control)
            if inputs is None:
                break
            runner.forward_step(inputs)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could block on the broken process group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """Ranks 1..N-1 as child processes, and rank 0's handle on them."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, spec.world_size)]  # (rank 0's end, the worker's)
        self.procs = [ctx.Process(target=_worker_main, args=(r, spec, send), name=f"kimitui-rank{r}", daemon=True)
                      for r, (_, send) in zip(range(1, spec.world_size), pipes)]
        for p, (_, send) in zip(self.procs, pipes):
            p.start()
            send.close()  # the worker holds its end; rank 0 then reads EOF when it dies
        self._closed = False
        self.control = None  # the CPU control group, once joined
        self.watchdog = Watchdog({r: (p, recv) for r, (p, (recv, _)) in enumerate(zip(self.procs, pipes), start=1)},
                                 on_failure=lambda _: stop_workers(self.procs))  # unblocks rank 0

    def join_as_rank0(self) -> ParallelState:
        """Join the process group as rank 0, failing fast if a worker dies before it connects."""
        box: dict = {}

        def connect():
            try:
                box["par"], box["control"] = init_rank(self.spec, 0)
            except BaseException as e:  # reported below
                box["error"] = e

        t = threading.Thread(target=connect, name="kimitui-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            if self.watchdog.failure:
                raise WorkerError(f"{self.watchdog.failure} during start-up (see its traceback above)")
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode} "
                                      "during start-up (see its traceback above)")
        if "error" in box:
            raise WorkerError(f"could not form the tensor-parallel group: {box['error']}")
        self.control = box["control"]
        return box["par"]

    def broadcast(self, obj) -> None:
        self.check()
        try:
            broadcast_object(self.control, obj)
        except Exception as e:
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
        if all(p.exitcode is None for p in self.procs):
            try:
                broadcast_object(self.control, None)
            except Exception:  # a dead peer: nothing left to tell
                pass
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
