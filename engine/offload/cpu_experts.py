"""CPU expert executor: routed experts that live in host RAM, computed by CPU threads while the
device computes its own experts of the same layer (submit, then sync), as KTransformers does.
On a device run the inputs and the result each cross in one non-blocking copy through pinned memory
shared by all layers (``engine.offload.host_staging``); ``engine.offload.overlap_meter`` times it.

On a multi-node (NUMA) host, ``split_across`` moves each node's share of the experts into memory
first-touched on that node and computes it there; see ``engine.offload.numa``."""

from __future__ import annotations

import copy
import functools
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kimitui.engine.offload import numa
from kimitui.engine.offload.host_staging import HostStaging
from kimitui.engine.offload.overlap_meter import LayerTiming


class NodeWorkers:
    """One worker thread per NUMA node CPU set, pinned when it starts, shared by every layer of a model
    (layers run one after another). Owned by whoever splits the executors (``numa.place_host_experts``)
    and shut down with it or when garbage collected."""

    def __init__(self):
        self._pools: dict[tuple[int, ...], ThreadPoolExecutor] = {}
        self._finalizer = weakref.finalize(self, _shutdown_all, self._pools)

    def pool(self, cpus: tuple[int, ...]) -> ThreadPoolExecutor:
        if cpus not in self._pools:
            self._pools[cpus] = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="kimitui-numa-node",
                initializer=numa.pin_current_thread,
                initargs=(cpus,),
            )
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
        # device runs: one staging block per model, shared by its layers (``share_staging``); this
        # layer's own until then. Allocated on the first device call only.
        self.staging = HostStaging()
        self.timing: LayerTiming | None = LayerTiming() if _timing_requested() else None
        self.nodes: list[tuple[tuple[int, ...], object, torch.Tensor]] = []  # (cpus, sub-stack, map) per node

    def split_across(self, topology: numa.NumaTopology, workers: NodeWorkers) -> list[tuple[int, int]]:
        """Give each node of ``topology`` a contiguous share of the slots (balanced by bytes), copied by a
        thread pinned to that node (first touch), and release the single stack's storage. -> the ranges."""
        if self.nodes:
            raise RuntimeError("CpuExpertExecutor.split_across: already split")
        self._workers = workers
        ranges = numa.assign_experts([_stack_bytes(self.stack, s) for s in range(self.stack.num)], len(topology.nodes))
        used = [(node, r) for node, r in zip(topology.nodes, ranges) if r[1] > r[0]]
        subs = numa.run_pinned(
            [node.cpus for node, _ in used], [functools.partial(_substack, self.stack, *r) for _, r in used]
        )
        for (node, (start, end)), sub in zip(used, subs):
            slot = self.expert_map
            node_map = torch.where((slot >= start) & (slot < end), slot - start, torch.full_like(slot, -1))
            self.nodes.append((node.cpus, sub, node_map))
        for name, t in _per_expert_tensors(self.stack).items():  # the node copies now hold the weights
            t.data = torch.empty(0, dtype=t.dtype)
        return ranges

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> PendingHostExperts:
        """Start the host experts' share of this layer on the worker thread and return at once.

        CPU tensors (a CPU-only run) go to the worker as they are. Device tensors take one
        non-blocking copy into the pinned staging block (``HostStaging``): this thread never waits
        for the device here, so it goes on to enqueue the device's own experts while the copy and the
        CPU work run; ``PendingHostExperts.add_to`` joins."""
        if x.device.type == "cpu":
            inputs, staging = (x, topk_ids, weights), None
        else:
            staging = self.staging
            inputs = staging.stage_inputs(x, topk_ids, weights)
        timing = self.timing
        future = self._pool.submit(self._compute, inputs, staging, timing)
        return PendingHostExperts(future, x.device, staging, timing)

    def _compute(self, inputs, staging: HostStaging | None, timing: LayerTiming | None) -> torch.Tensor:
        # on the worker thread: [T, D] on the CPU (in the pinned output block on a device run)
        t0 = time.perf_counter()
        if staging is not None:
            staging.wait_inputs()
        t1 = time.perf_counter()
        x, ids, w = inputs
        if not self.nodes:
            out = self.stack.run_subset(self.expert_map, x, ids, w)
        else:
            parts = [
                self._workers.pool(cpus).submit(sub.run_subset, node_map, x, ids, w)
                for cpus, sub, node_map in self.nodes
            ]
            out = _sum_parts(parts, x.dtype)
        if staging is not None:
            out = staging.output(x.shape[0]).copy_(out)
        if timing is not None:
            timing.add_host(t1 - t0, time.perf_counter() - t1)
        return out

    def graph_job(
        self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor, staging: HostStaging
    ) -> GraphHostJob:
        """Inside a piecewise decode graph's capture (engine/runner/piecewise.py): stage this layer's rows
        into ``staging`` (frozen, shared by the graphs' layers) with the copies captured and no event;
        -> the job whose ``start`` / ``finish`` the graph runs at its two cuts on every replay."""
        inputs = staging.stage_inputs(x, topk_ids, weights, record=False)
        return GraphHostJob(self, inputs, staging)

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


class PendingHostExperts:
    """A layer's host experts in flight (``CpuExpertExecutor.submit``)."""

    def __init__(self, future: Future, device: torch.device, staging: HostStaging | None, timing: LayerTiming | None):
        self._future, self.device, self._staging, self._timing = future, device, staging, timing

    def result(self) -> torch.Tensor:
        """Wait for the worker; -> [T, D] on the CPU (a view of the pinned block on a device run:
        valid until the next layer's worker writes it)."""
        if self._timing is None:
            return self._future.result()
        t0 = time.perf_counter()
        out = self._future.result()
        self._timing.add_wait(time.perf_counter() - t0)
        return out

    def add_to(self, y: torch.Tensor | None) -> torch.Tensor:
        """``y`` (the device experts' [T, D] output, owned by the caller, or None) plus the host
        result, on ``y``'s device: one non-blocking copy from the pinned block, ordered on the
        current stream (no host sync)."""
        out = self.result()
        if self._staging is not None:
            out = self._staging.to_device(out, self.device)
        return out if y is None else y.add_(out)


class GraphHostJob:
    """A layer's host experts as a replayed piecewise decode graph runs them: the staged inputs and the
    pinned output are the same blocks at every replay (captured copies read and write them)."""

    def __init__(self, executor: CpuExpertExecutor, inputs: tuple, staging: HostStaging):
        self.executor, self.inputs, self.staging = executor, inputs, staging
        self._future: Future | None = None

    def start(self) -> None:
        """After the segment that staged the inputs: mark them sent, hand the step's real rows to the
        worker (``HostStaging.live_rows``: a bucket's padding rows cost no CPU time; their rows of
        the output block keep older finite values, which only padding rows read)."""
        self.staging.mark_sent()
        ex = self.executor
        rows = self.staging.live_rows
        inputs = self.inputs if rows is None else tuple(t[:rows] for t in self.inputs)
        self._future = ex._pool.submit(ex._compute, inputs, self.staging, ex.timing)

    def finish(self) -> None:
        """Before the segment that copies the output to the device: wait for the worker."""
        future, self._future = self._future, None
        if future is None:
            raise RuntimeError("GraphHostJob.finish before start (segments replayed out of order)")
        timing = self.executor.timing
        t0 = time.perf_counter()
        future.result()
        if timing is not None:
            timing.add_wait(time.perf_counter() - t0)


def share_staging(model: torch.nn.Module) -> int:
    """Give every host-expert executor of ``model`` one staging block (layers run one after another,
    so one block sized to the largest step serves them all); -> executors sharing it."""
    staging, count = HostStaging(), 0
    for m in model.modules():
        executor = getattr(m, "executor", None)
        if isinstance(executor, CpuExpertExecutor):
            executor.staging = staging
            count += 1
    return count


def _timing_requested() -> bool:
    # read when a layer is built, never per call (see engine.offload.overlap_meter)
    return os.environ.get("KIMITUI_OFFLOAD_TIMING", "").strip().lower() in ("1", "true", "on", "yes")


def place_host_experts(model: torch.nn.Module, policy: numa.NumaPolicy, topology: numa.NumaTopology):
    """Split every host-expert executor of ``model`` across ``topology``'s nodes when the policy says so
    (and give them one shared staging block, ``cpu_experts.share_staging``); -> (number of layers
    split, the node workers they share, or None)."""
    share_staging(model)  # one pinned staging block for all layers (device runs), whatever the policy
    if not policy.split(topology):
        return 0, None

    workers = NodeWorkers()
    count = 0
    for m in model.modules():
        executor = getattr(m, "executor", None)
        if executor is not None and hasattr(executor, "split_across"):
            executor.split_across(topology, workers)
            count += 1
    return count, workers
