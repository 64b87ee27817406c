"""One process per device over torch.distributed: rank 0 is the engine process (scheduler,
tokenizer, sampling); ranks 1..N-1 are spawned workers that mirror every model step.

Workers receive each step's ``StepInputs`` by broadcast and run the same forward pass, so the
model's all-reduces and all-gathers pair up. A worker that dies surfaces in rank 0 as a
``WorkerError`` (its collective fails once the peer's socket closes), never as a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.state import ParallelState

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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def init_rank(spec: WorkerSpec, rank: int) -> ParallelState:
    """Join the process group: NCCL (RCCL on ROCm) between GPUs, gloo on the CPU."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.world_size, timeout=_TIMEOUT)
    return ParallelState(rank=rank, world_size=spec.world_size, group=dist.group.WORLD)


def broadcast_object(obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker_main(rank: int, spec: WorkerSpec) -> None:
    from engine.config import ModelConfig
    from engine.kv_cache.pool import KVCachePool
    from engine.loader import load_model
    from engine.runner import ModelRunner

    try:
        torch.set_num_threads(spec.threads_per_rank)
        device = rank_device(spec.device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        par = init_rank(spec, rank)
        config = ModelConfig.from_pretrained(spec.model_dir)
        dtype = getattr(torch, spec.dtype)
        model, _ = load_model(config, spec.model_dir, device, dtype, spec.max_model_len, par=par,
                              expert_placement=spec.expert_placement)
        # Rank 0 sized the pool; every rank allocates the same blocks and state slots (its own
        # share of each layer), since the scheduler's block and slot ids index all of them.
        num_blocks, max_num_seqs, num_snapshots = broadcast_object()
        pool = KVCachePool(model.cache_specs(dtype), num_blocks, spec.block_size, max_num_seqs, device,
                           num_snapshots)
        runner = ModelRunner(model, pool.caches, spec.block_size, device)
        while True:
            inputs = broadcast_object()
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
        self.procs = [ctx.Process(target=_worker_main, args=(r, spec), name=f"kimitui-rank{r}", daemon=True)
                      for r in range(1, spec.world_size)]
        for p in self.procs:
            p.start()
        self._closed = False

    def join_as_rank0(self) -> ParallelState:
        """Join the process group as rank 0, failing fast if a worker dies before it connects."""
        box: dict = {}

        def connect():
            try:
                box["par"] = init_rank(self.spec, 0)
            except BaseException as e:  # reported below
                box["error"] = e

        t = threading.Thread(target=connect, name="kimitui-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode} "
                                      "during start-up (see its traceback above)")
        if "error" in box:
            raise WorkerError(f"could not form the tensor-parallel group: {box['error']}")
        return box["par"]

    def broadcast(self, obj) -> None:
        self.check()
        try:
            broadcast_object(obj)
        except Exception as e:
            raise WorkerError(self._failure(e)) from None

    def check(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise WorkerError(f"tensor-parallel worker rank {rank} exited with code {p.exitcode}")

    def _failure(self, error: Exception) -> str:
        for rank, p in enumerate(self.procs, start=1):
            p.join(timeout=2)
            if p.exitcode is not None:
                return f"tensor-parallel worker rank {rank} exited with code {p.exitcode} ({error})"
        return f"tensor-parallel step failed: {error}"

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if all(p.exitcode is None for p in self.procs):
            try:
                broadcast_object(None)
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
