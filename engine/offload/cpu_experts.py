"""CPU expert executor: routed experts that live in host RAM, computed by CPU threads while the
device computes its own experts of the same layer (submit, then sync), as KTransformers does.

On a multi-node (NUMA) host, ``split_across`` moves each node's share of the experts into memory
first-touched on that node and computes it there; see ``engine.offload.numa``."""

from __future__ import annotations

import copy
import functools
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.offload import numa


class NodeWorkers:
    """One worker thread per NUMA node CPU set, pinned when it starts, shared by every layer of a model
    (layers run one after another). Owned by whoever splits the executors (``numa.place_host_experts``)
    and shut down with it or when garbage collected."""

    def __init__(self):
        self._pools: dict[tuple[int, ...], ThreadPoolExecutor] = {}
        self._finalizer = weakref.finalize(self, _shutdown_all, self._pools)

    def pool(self, cpus: tuple[int, ...]) -> ThreadPoolExecutor:
        if cpus not in self._pools:
            self._pools[cpus] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimitui-numa-node",
                                                   initializer=numa.pin_current_thread, initargs=(cpus,))
        return self._pools[cpus]

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown_all(pools: dict) -> None:
    for p in pools.values():
        p.shutdown(wait=False)


def _stack_bytes(stack, slot: int) -> int:
    return sum(t[slot].numel() * t.element_size() for t in _per_expert_tensors(stack).values())


def _per_expert_tensors(stack) -> dict[str, torch.Tensor]:
    # Parameters and buffers stacked over experts ([num, ...]); emptied checkpoint layouts ([0]) excluded.
    named = list(stack.named_parameters(recurse=False)) + list(stack.named_buffers(recurse=False))
    return {n: t for n, t in named if t.dim() > 0 and t.shape[0] == stack.num and t.numel() > 0}


def _substack(stack, start: int, end: int):
    """Slots [start, end) of ``stack`` as a stack of their own, copied by the calling thread."""
    sub = copy.copy(stack)  # same class, format and forward; fresh parameter dicts below
    sub._parameters, sub._buffers, sub._non_persistent_buffers_set = {}, {}, set()
    per_expert = _per_expert_tensors(stack)
    for name, p in stack.named_parameters(recurse=False):
        t = numa.first_touch_copy(p.data[start:end]) if name in per_expert else p.data
        q = torch.nn.Parameter(t, requires_grad=False)
        q.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_cdata"})  # e.g. values_per_element
        sub.register_parameter(name, q)
    for name, b in stack.named_buffers(recurse=False):
        sub.register_buffer(name, numa.first_touch_copy(b[start:end]) if name in per_expert else b, persistent=False)
    sub.num = end - start
    return sub


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
        self._workers: NodeWorkers | None = None
        self.nodes: list[tuple[tuple[int, ...], object, torch.Tensor]] = []  # (cpus, sub-stack, map) per node

    def split_across(self, topology: numa.NumaTopology, workers: NodeWorkers) -> list[tuple[int, int]]:
        """Give each node of ``topology`` a contiguous share of the slots (balanced by bytes), copied by a
        thread pinned to that node (first touch), and release the single stack's storage. -> the ranges."""
        if self.nodes:
            raise RuntimeError("CpuExpertExecutor.split_across: already split")
        self._workers = workers
        ranges = numa.assign_experts([_stack_bytes(self.stack, s) for s in range(self.stack.num)],
                                     len(topology.nodes))
        used = [(node, r) for node, r in zip(topology.nodes, ranges) if r[1] > r[0]]
        subs = numa.run_pinned([node.cpus for node, _ in used],
                               [functools.partial(_substack, self.stack, *r) for _, r in used])
        for (node, (start, end)), sub in zip(used, subs):
            slot = self.expert_map
            node_map = torch.where((slot >= start) & (slot < end), slot - start, torch.full_like(slot, -1))
            self.nodes.append((node.cpus, sub, node_map))
        for name, t in _per_expert_tensors(self.stack).items():  # the node copies now hold the weights
            t.data = torch.empty(0, dtype=t.dtype)
        return ranges

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> Future:
        """Start the host experts' share of this layer; ``.result()`` is [T, D] on the CPU."""
        from engine.layers.moe import run_subset

        # The copies to host wait for the device; the matmuls then run beside the device's experts.
        x_cpu, ids_cpu, w_cpu = x.to("cpu"), topk_ids.to("cpu"), weights.to("cpu")
        if not self.nodes:
            return self._pool.submit(run_subset, self.stack, self.expert_map, x_cpu, ids_cpu, w_cpu)
        parts = [self._workers.pool(cpus).submit(run_subset, sub, node_map, x_cpu, ids_cpu, w_cpu)
                 for cpus, sub, node_map in self.nodes]
        return self._pool.submit(_sum_parts, parts, x_cpu.dtype)

    def shutdown(self) -> None:
        """Stop the worker thread once its queued work is done."""
        self._finalizer.detach()
        self._pool.shutdown(wait=True)


def _sum_parts(parts: list[Future], dtype: torch.dtype) -> torch.Tensor:
    # [T, D] per node; summed in float32 like the kernels' own accumulation
    out = parts[0].result().float()
    for p in parts[1:]:
        out += p.result().float()
    return out.to(dtype)
