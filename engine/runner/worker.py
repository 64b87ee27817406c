"""One rank, built the same way on rank 0 and on every tensor-parallel worker: load this rank's shard,
agree on the cache's shape, allocate the cache, make the runner, say ready, capture decode graphs.

Rank 0 decides the cache's shape from what is left after loading (``LLMEngine._cache_shape``) and sends
it to the workers; a worker receives it. Everything else is this one function, so the ranks cannot
drift apart (a graph bucket captured on one rank and not another would hang the first collective).
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.kv_cache.pool import KVCachePool
from kimitui.engine.loader import load_model
from kimitui.engine.parallel.state import ParallelState
from kimitui.engine.parallel.watchdog import Heartbeat
from kimitui.engine.parallel.workers import WorkerSpec, init_rank, next_message, rank_device
from kimitui.engine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class CacheShape:
    """What rank 0 decides once the weights are loaded, and every rank allocates alike: the
    scheduler's block and slot ids index every rank's cache."""

    num_blocks: int
    max_num_seqs: int
    num_snapshots: int
    num_spec_slots: int
    num_spec_tokens: int
    keep_hidden: bool = False  # rank 0 only: return the aux hidden states a model drafter reads

    def message(self) -> tuple:
        return (self.num_blocks, self.max_num_seqs, self.num_snapshots, self.num_spec_slots, self.num_spec_tokens)


@dataclass(frozen=True)
class RankSpec:
    config: ModelConfig
    model_dir: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    expert_placement: list | None
    decode_graphs: bool | None
    capture_graphs: bool


@dataclass
class Rank:
    model: nn.Module
    load_report: object
    cache_pool: KVCachePool
    runner: ModelRunner


def build_rank(
    spec: RankSpec,
    par: ParallelState,
    cache_shape: Callable[[nn.Module], CacheShape | None],
    ready: Callable[[], None],
    workers=None,
    progress=None,
) -> Rank | None:
    """Build one rank; ``cache_shape(model)`` decides (rank 0) or receives (a worker) the cache's shape,
    None when there is nothing to build (rank 0 gave up); ``ready()`` returns once every rank is built."""
    model, report = load_model(
        spec.config, spec.model_dir, spec.device, spec.dtype, spec.max_model_len, progress, par, spec.expert_placement
    )
    shape = cache_shape(model)
    if shape is None:
        return None
    pool = KVCachePool(
        model.cache_specs(spec.dtype),
        shape.num_blocks,
        spec.block_size,
        shape.max_num_seqs,
        spec.device,
        shape.num_snapshots,
        shape.num_spec_slots,
    )
    # fixed-capacity decode tables and the same decode graph choice on every rank: graphed steps pad to
    # the same bucket everywhere, so the collectives inside match
    runner = ModelRunner(
        model,
        pool.caches,
        spec.block_size,
        spec.device,
        workers,
        shape.max_num_seqs,
        spec.max_model_len,
        spec.decode_graphs,
        num_spec_tokens=shape.num_spec_tokens,
        spec_scratch_base=pool.spec_scratch_base,
        keep_hidden=shape.keep_hidden,
    )
    ready()
    if runner.graphs is not None and spec.capture_graphs:
        runner.graphs.capture_all()  # every rank at the same point, after ready: same order
        if runner.verify_graphs is not None:
            runner.verify_graphs.capture_all()
    return Rank(model, report, pool, runner)


def worker_main(rank: int, spec: WorkerSpec, heartbeat, work) -> None:
    """Rank ``rank`` >= 1: build, then run every step rank 0 sends until its pipe closes."""
    if heartbeat is not None:
        Heartbeat(heartbeat)  # rank 0's watchdog hears this process is alive (engine/parallel/watchdog.py)
    try:
        torch.set_num_threads(spec.threads_per_rank)
        device = rank_device(spec.device_type, rank, spec.device_base)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        par = init_rank(spec, rank)
        built = build_rank(
            RankSpec(
                ModelConfig.from_pretrained(spec.model_dir),
                spec.model_dir,
                device,
                getattr(torch, spec.dtype),
                spec.max_model_len,
                spec.block_size,
                spec.expert_placement,
                spec.decode_graphs,
                spec.capture_graphs,
            ),
            par,
            lambda _model: _receive_shape(work),
            ready=lambda: par.all_reduce(torch.zeros(1, device=device)),
        )
        if built is None:
            return
        while True:
            try:
                inputs = next_message(work)
            except EOFError:  # rank 0 closed its end: shut down, or died (nobody is left to serve)
                break
            built.runner.forward_step(inputs)
    except Exception:
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # skip atexit handlers that could block on the broken process group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.freeze()  # nothing left to collect: the interpreter's exit skips a full collection (1.7 s on a loaded host)


def _receive_shape(work) -> CacheShape | None:
    try:
        return CacheShape(*next_message(work))
    except EOFError:  # rank 0's own start-up failed (it reports why) and it closed the pipe
        return None


__all__ = ["CacheShape", "Rank", "RankSpec", "build_rank", "worker_main"]
