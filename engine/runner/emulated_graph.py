"""A stand-in for ``torch.cuda.CUDAGraph`` on the CPU: record the launches of a captured region, replay them.

The emulated device path (``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1``) runs the Triton kernels a
GPU runs, on the CPU. Decode graphs there used to be direct calls of the model on the static buffers
(engine/runner/graphs.py), which proves the buffers and the padding but not what a graph really does:
a replay runs the *recorded kernels* again on the *same memory*, without any of the Python that
issued them. Whatever that Python computed at capture time (a row count, a branch, a host result) is
frozen into the graph. This class gives the CPU those semantics, so that a capture that leans on
per-step Python shows up as a wrong result under test, as it would on a GPU:

- ``capture_begin()`` / ``capture_end()`` bracket the region on the calling thread. Every ATen op that
  launches a kernel (the ops ``kernels.launch_count`` counts) and every Triton launch (``JITFunction.run``
  / the interpreter's ``InterpretedFunction.run``) is recorded with its arguments, the tensors by
  reference. Views and allocations are not recorded (they launch nothing); the ops a Triton launch
  runs inside the interpreter are not either (the launch is replayed whole).
- ``replay()`` issues the recorded launches again, in order, on the recorded tensors. An op that
  returned a new tensor at capture writes its replayed result into that tensor (a graph's output
  lives at a fixed address in its memory pool; here the captured tensor object is that address).
  In-place ops and Triton kernels write where they wrote before.
- Inside a capture, a host sync (``.item()``, a data-dependent output size) raises, as it does on a
  GPU ("operation not permitted when stream is capturing"). Work on other threads is not recorded:
  the host experts' worker thread stays outside, as it is outside a CUDA graph.

A replay counts as one launch in ``kernels.launch_count`` (a graph launch), and the ops it issues are
not counted again. Collectives are refused (the emulation is for one rank). The recording holds the
tensors it touched alive, as a graph's memory pool does.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kimitui.kernels import launch_count

_NO_KERNEL = launch_count.NO_KERNEL_OPS
_HOST_SYNC = launch_count.DATA_DEPENDENT_OPS
_COLLECTIVES = launch_count.COLLECTIVE_NAMESPACES
_state = threading.local()  # .recorder: the EmulatedGraph capturing on this thread, if any


class GraphCaptureError(RuntimeError):
    """An op a captured region cannot hold (a host sync, a collective)."""


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


class _AtenRecorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        graph = self.graph
        if graph.triton_depth:  # the interpreter's own host copies inside a Triton launch
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace in _COLLECTIVES:
            raise GraphCaptureError(
                f"emulated graph capture: collective {func} inside a captured segment (the emulation is for one rank)"
            )
        if name in _HOST_SYNC:
            raise GraphCaptureError(f"emulated graph capture: {func} needs the host (a sync) inside a captured segment")
        out = func(*args, **kwargs)
        if func.namespace == "aten" and name not in _NO_KERNEL and _tensors(out):
            if func.is_view and not launch_count.copied(out, args):
                return out  # a view of recorded memory: nothing to launch again
            graph.ops.append(("aten", func, args, kwargs, _tensors(out)))
        return out


class EmulatedGraph:
    """``capture_begin`` / ``capture_end`` / ``replay`` / ``pool`` as ``torch.cuda.CUDAGraph`` has them."""

    def __init__(self):
        self.ops: list[tuple] = []
        self.triton_depth = 0
        self._mode: _AtenRecorder | None = None
        self._patched: dict[type, object] = {}
        self.captured = False

    # -- capture ------------------------------------------------------------------------------
    def capture_begin(self, pool=None) -> None:
        if getattr(_state, "recorder", None) is not None:
            raise GraphCaptureError("emulated graph capture: another capture is already running on this thread")
        if self.captured:
            raise GraphCaptureError("emulated graph capture: this graph is already captured")
        _state.recorder = self
        graph = self

        def wrap(original):
            def run(fn, *args, **kwargs):
                rec = getattr(_state, "recorder", None)
                if rec is not graph or kwargs.get("warmup") or graph.triton_depth:
                    return original(fn, *args, **kwargs)
                graph.ops.append(("triton", fn, args, kwargs, original))
                graph.triton_depth += 1
                try:
                    return original(fn, *args, **kwargs)
                finally:
                    graph.triton_depth -= 1

            return run

        for cls in launch_count.launcher_classes():
            self._patched[cls] = cls.run
            cls.run = wrap(cls.run)
        self._mode = _AtenRecorder(self)
        self._mode.__enter__()

    def capture_end(self) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            for cls, original in self._patched.items():
                cls.run = original
            self._patched.clear()
            _state.recorder = None
            self.captured = True

    def pool(self):
        return None  # tensors are kept alive by the recording itself

    # -- replay -------------------------------------------------------------------------------
    @torch.inference_mode()
    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("EmulatedGraph.replay: nothing captured")
        with launch_count.graph_launch("emulated"):
            for kind, fn, args, kwargs, extra in self.ops:
                if kind == "triton":
                    extra(fn, *args, **kwargs)
                    continue
                new = _tensors(fn(*args, **kwargs))
                for old, got in zip(extra, new):
                    if not _same_memory(old, got):
                        old.copy_(got)

    @property
    def num_launches(self) -> int:
        """Kernels the region launches (what one replay stands for)."""
        return len(self.ops)
