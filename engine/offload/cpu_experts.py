"""CPU expert executor: routed experts that live in host RAM, computed by CPU threads while the
device computes its own experts of the same layer (submit, then sync), as KTransformers does."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

# One worker thread (started on first use): torch's intra-op threads already spread each matmul
# over the cores, and layers run one after another.
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimitui-cpu-experts")


class CpuExpertExecutor:
    def __init__(self, stack, expert_map: torch.Tensor):
        self.stack = stack  # ExpertStack on the CPU
        self.expert_map = expert_map  # [E] slot in the stack or -1, on the CPU

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> Future:
        """Start the host experts' share of this layer; ``.result()`` is [T, D] on the CPU."""
        from engine.layers.moe import run_subset

        # The copies to host wait for the device; the matmuls then run beside the device's experts.
        x_cpu, ids_cpu, w_cpu = x.to("cpu"), topk_ids.to("cpu"), weights.to("cpu")
        return _POOL.submit(run_subset, self.stack, self.expert_map, x_cpu, ids_cpu, w_cpu)
