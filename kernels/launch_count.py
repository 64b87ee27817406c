"""Count what a piece of code launches: ATen ops, Triton kernels, collectives and host syncs.

The decode step is launch-bound when it runs thousands of tiny ops; this tool measures that on any
machine, including a CPU under ``TRITON_INTERPRET=1`` (the emulated device path), so "at most N
kernels per layer, no host sync in the forward" can be a test instead of a profiler session::

    with count_launches() as counts:
        model_step()
    assert counts.kernels <= 30 * num_layers and not counts.host_syncs

- ATen ops are seen through a ``TorchDispatchMode``. Views and allocations (``empty``) launch no
  kernel and are not counted (an op that may alias, such as ``to``, counts when it copied); ops run *inside* a Triton launch (the interpreter's own host copies)
  are not counted either.
- Triton launches are counted by wrapping ``JITFunction.run`` and the interpreter's
  ``InterpretedFunction.run`` for the duration of the ``with`` block (restored on exit). This is the
  one place kimitui swaps a library attribute, and only inside this diagnostic context.
- Collectives: ops of the ``c10d`` / ``_c10d_functional`` namespaces (``dist.all_reduce`` etc.).
- Host syncs: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``), ops whose output
  size depends on the data (``nonzero``, ``masked_select``, ``unique``...: they sync on a GPU to size
  their output) and copies from a device tensor to the CPU. On a CPU, ``.cpu()`` and ``.tolist()``
  of a CPU tensor dispatch nothing; the other kinds are seen as on a GPU.
- Graph launches: a replayed decode graph (``torch.cuda.CUDAGraph`` on a GPU,
  ``engine.emulated_graph.EmulatedGraph`` on the emulated device) is one launch from the host, whatever
  it holds: the runner wraps each replay in ``graph_launch``, which counts it in ``graphs`` and keeps
  the ops an emulated replay issues out of the other counts. ``launches`` is what the host launches
  per step: kernels run outside graphs plus graph launches.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "lift_fresh"}
_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
    "repeat_interleave",
    "_local_scalar_dense",
    "is_nonzero",
}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
# public names for engine.emulated_graph, which records what this module counts
NO_KERNEL_OPS, DATA_DEPENDENT_OPS, COLLECTIVE_NAMESPACES = _NO_KERNEL, _DATA_DEPENDENT, _COLLECTIVE_NAMESPACES
_active: list = []  # the LaunchCounts of every count_launches block now open
_replay = threading.local()  # .depth > 0 while this thread replays a graph (graph_launch)


def _replaying() -> bool:
    return getattr(_replay, "depth", 0) > 0


@contextlib.contextmanager
def graph_launch(kind: str = "graph"):
    """Around one graph replay: counted once in ``LaunchCounts.graphs[kind]`` of every open
    ``count_launches`` block; the ops the replay issues (an emulated graph) are not counted again."""
    if not _replaying():
        for counts in list(_active):
            counts.graphs[kind] += 1
    _replay.depth = getattr(_replay, "depth", 0) + 1
    try:
        yield
    finally:
        _replay.depth -= 1


@dataclass
class LaunchCounts:
    """What ran inside one ``count_launches`` block, by op or kernel name."""

    aten: Counter = field(default_factory=Counter)  # ATen ops that launch a kernel, outside Triton
    triton: Counter = field(default_factory=Counter)  # Triton launches by kernel name
    collectives: Counter = field(default_factory=Counter)
    host_syncs: Counter = field(default_factory=Counter)
    graphs: Counter = field(default_factory=Counter)  # graph launches (replays) by kind

    @property
    def kernels(self) -> int:
        """ATen kernels plus Triton launches outside graphs: the number the launch budget is about."""
        return sum(self.aten.values()) + sum(self.triton.values())

    @property
    def launches(self) -> int:
        """What the host launched: kernels outside graphs plus one per graph replay."""
        return self.kernels + sum(self.graphs.values())

    def summary(self) -> str:
        graphs = f", {sum(self.graphs.values())} graph launches" if self.graphs else ""
        return (
            f"{self.kernels} kernels ({sum(self.aten.values())} ATen, {sum(self.triton.values())} Triton), "
            f"{sum(self.collectives.values())} collectives, {sum(self.host_syncs.values())} host syncs{graphs}"
        )


def _is_device_to_host(name: str, args, kwargs) -> bool:
    if name == "_to_copy":
        src, dst = args[0], kwargs.get("device")
        return dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu"
    if name == "copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"
    return False


def _has_tensor(out) -> bool:
    if isinstance(out, (tuple, list)):
        return any(isinstance(o, torch.Tensor) for o in out)
    return isinstance(out, torch.Tensor)


def copied(out, args) -> bool:
    # Ops whose schema may alias (``to``, ``contiguous``, ``reshape`` under inference mode) launch a
    # copy kernel when their output does not share storage with an input (a cast, a gather of strides).
    if not isinstance(out, torch.Tensor):
        return False
    ptr = out.untyped_storage().data_ptr()
    return all(not isinstance(a, torch.Tensor) or a.untyped_storage().data_ptr() != ptr for a in args)


class _Recorder(TorchDispatchMode):
    def __init__(self, counts: LaunchCounts):
        super().__init__()
        self.counts = counts
        self.triton_depth = 0  # > 0 while a Triton launch runs: its host-side ops are not the model's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.triton_depth == 0 and not _replaying():
            name = func.overloadpacket.__name__
            if func.namespace in _COLLECTIVE_NAMESPACES:
                self.counts.collectives[name] += 1
            elif func.namespace == "aten" and (not func.is_view or copied(out, args)) and name not in _NO_KERNEL:
                sync = name in _DATA_DEPENDENT or _is_device_to_host(name, args, kwargs)
                if sync:
                    self.counts.host_syncs[name] += 1
                if sync or _has_tensor(out):  # not dtype queries such as promote_types
                    self.counts.aten[name] += 1
        return out


def launcher_classes() -> list[type]:
    """The Triton launcher classes whose ``run`` a launch goes through (none without Triton)."""
    try:
        from triton.runtime.jit import JITFunction  # optional dependency: triton
    except Exception:  # no (working) triton: nothing to wrap
        return []
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction  # optional dependency: triton

        if not issubclass(InterpretedFunction, JITFunction):
            classes.append(InterpretedFunction)
    except Exception:
        pass
    return classes


@contextlib.contextmanager
def count_launches():
    """Count launches inside the ``with`` block; yields the ``LaunchCounts`` it fills."""
    counts = LaunchCounts()
    recorder = _Recorder(counts)
    originals = {cls: cls.run for cls in launcher_classes()}

    def wrap(original):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup") or _replaying():  # compiles only / inside a counted graph launch
                return original(self, *args, **kwargs)
            if recorder.triton_depth == 0:
                counts.triton[getattr(self, "__name__", None) or self.fn.__name__] += 1
            recorder.triton_depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                recorder.triton_depth -= 1

        return run

    for cls, original in originals.items():
        cls.run = wrap(original)
    _active.append(counts)
    try:
        with recorder:
            yield counts
    finally:
        _active.remove(counts)
        for cls, original in originals.items():
            cls.run = original
