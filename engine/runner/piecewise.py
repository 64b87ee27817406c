"""Piecewise decode graphs: a decode step with host-RAM experts, captured as segments cut at the joins.

With ``--cpu-offload`` part of every MoE layer's routed experts is computed by CPU threads
(engine/offload/cpu_experts.py). A whole-step CUDA graph cannot hold that: the CPU work is not a
kernel, and the host must hand the layer's routed tokens to the worker and wait for its result. The
step therefore ran eagerly, 1,250-2,300 launches per step for K3. As vLLM does for the ops it keeps
out of its graphs (piecewise CUDA graphs, ``vllm/compilation/cuda_piecewise_backend.py``), the step
is captured in pieces, and the host work runs between the pieces' replays. Per MoE layer with host
experts there are two cuts:

    segment i:    ... attention, router, routing counts, [K3: latent down-projection],
                  the routed rows staged into the pinned input block (one kernel + one D2H copy)
    -- cut A --   host: record "inputs ready", hand the rows to the layer's CPU worker
    segment i+1:  the device's own routed experts, the shared experts (everything that does not need
                  the host result: it runs on the GPU while the CPU computes)
    -- cut B --   host: wait for the worker (it wrote the pinned output block)
    segment i+2:  the pinned output copied to the device (H2D), added, [K3: all-reduce, norm,
                  latent up-projection], the rest of the layer and the next layers ... up to the
                  next cut A

Everything a segment reads or writes is at a fixed address: the static inputs of the graph runner,
the graph pool's intermediates, and one pinned staging pair (``HostStaging``, frozen at its first
reservation for ``max_num_seqs`` rows) shared by every layer. The copies between host and device are
*inside* the segments (memcpy nodes to and from page-locked memory, which CUDA and HIP graphs hold);
the events the worker waits on are recorded by the host between replays, never inside a capture.
Padding rows are staged with the bucket but the CPU computes only the step's real rows (the runner
sets ``HostStaging.live_rows`` before each replay): a padding row's rows of the output block keep older
finite values, which only that padding row reads. Padding rows write nothing: their outputs are
discarded and their cache / state slots are -1 (engine/runner/graph_padding.py).

A bucket's capture runs the model once with ``RoutedExperts.graph_breaks`` set to this object: the
MoE layer calls ``cut(action)`` where a segment ends; the action is what the host runs there at
every replay (at capture time it runs nothing: the values a capture sees are never used). The
Python between the cuts runs only at capture; a replay runs the recorded kernels and the actions.

On a GPU each segment is a ``torch.cuda.CUDAGraph`` sharing the runner's memory pool. On the
emulated device each is an ``engine.emulated_graph.EmulatedGraph`` (launches recorded, replayed on the
same tensors), so the CPU can show that a replayed step equals an eager one and count its launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kimitui.kernels import launch_count


class SegmentedGraph:
    """One bucket's decode step as graph segments with host actions between them."""

    def __init__(self, new_graph: Callable[[], object], pool=None, kind: str = "cuda", max_rows: int = 0):
        self._new_graph = new_graph
        self.pool = pool
        self.kind = kind
        self.max_rows = max_rows  # rows the staging must hold for any bucket (the largest bucket)
        self.segments: list = []
        self.actions: list[Callable[[], None]] = []
        self._open = None

    # -- capture ------------------------------------------------------------------------------
    def begin(self) -> None:
        graph = self._new_graph()
        if self.kind == "cuda":
            graph.capture_begin(pool=self.pool)
        else:
            graph.capture_begin()
        self._open = graph

    def end(self) -> None:
        graph, self._open = self._open, None
        if graph is None:
            return
        graph.capture_end()
        if self.pool is None and self.kind == "cuda":
            self.pool = graph.pool()
        self.segments.append(graph)

    def cut(self, action: Callable[[], None]) -> None:
        """End the segment being captured here; ``action`` runs at this point of every replay; the
        next segment starts."""
        if self._open is None:
            raise RuntimeError("SegmentedGraph.cut outside a capture")
        self.end()
        self.actions.append(action)
        self.begin()

    def abort(self) -> None:
        """End a capture that failed half way (its segments are not replayed)."""
        if self._open is not None:
            try:
                self._open.capture_end()
            except Exception:
                pass
            self._open = None

    # -- replay -------------------------------------------------------------------------------
    def replay(self) -> None:
        for i, graph in enumerate(self.segments):
            if self.kind == "cuda":
                with launch_count.graph_launch("cuda"):
                    graph.replay()
            else:
                graph.replay()  # an EmulatedGraph counts its own launch
            if i < len(self.actions):
                self.actions[i]()

    @property
    def num_segments(self) -> int:
        return len(self.segments)


def segmented_capture(
    new_graph: Callable[[], object],
    forward: Callable[[], torch.Tensor],
    experts: list,
    pool=None,
    kind: str = "cuda",
    max_rows: int = 0,
) -> tuple[SegmentedGraph, torch.Tensor]:
    """Capture ``forward()`` as segments cut at the host joins of ``experts`` (the ``RoutedExperts``
    with host experts; none: one segment). -> (the graph, the output tensor its replays write)."""
    seg = SegmentedGraph(new_graph, pool, kind, max_rows)
    for m in experts:
        m.graph_breaks = seg
    try:
        seg.begin()
        out = forward()
        seg.end()
    except BaseException:
        seg.abort()
        raise
    finally:
        for m in experts:
            m.graph_breaks = None
    return seg, out
