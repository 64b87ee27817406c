"""CPU expert executor: routed experts that live in host RAM, computed by a CPU thread while the
device computes its own experts of the same layer (submit, then sync), as KTransformers does."""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CpuExpertExecutor:
    """Runs one layer's host-RAM experts on a worker thread of its own, created with the executor
    and shut down with it (``shutdown``, or when it is garbage collected)."""

    def __init__(self, stack, expert_map: torch.Tensor):
        self.stack = stack  # ExpertStack on the CPU
        self.expert_map = expert_map  # [E] slot in the stack or -1, on the CPU
        # One worker thread (started on the first submit): torch's intra-op threads already spread
        # each matmul over the cores, and layers run one after another.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimitui-cpu-experts")
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False)

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> Future:
        """Start the host experts' share of this layer; ``.result()`` is [T, D] on the CPU."""
        from engine.layers.moe import run_subset

        # The copies to host wait for the device; the matmuls then run beside the device's experts.
        x_cpu, ids_cpu, w_cpu = x.to("cpu"), topk_ids.to("cpu"), weights.to("cpu")
        return self._pool.submit(run_subset, self.stack, self.expert_map, x_cpu, ids_cpu, w_cpu)

    def shutdown(self) -> None:
        """Stop the worker thread once its queued work is done."""
        self._finalizer.detach()
        self._pool.shutdown(wait=True)
