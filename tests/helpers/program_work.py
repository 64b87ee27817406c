"""Measure how much vector work each Triton program does, under TRITON_INTERPRET=1.

The interpreter runs the grid one program at a time and builds every tensor of a kernel through one
builder object (``triton.runtime.interpreter.interpreter_builder``), except reductions and scans,
which go through ``ReduceScanOpInterface.apply``. Counting the elements each of those calls
produces, keyed by the program that made them, gives a per-program work figure measured from the
kernel itself (loop trips included), not from a model of it. On a GPU the programs run side by
side, so the largest program bounds the kernel's time; a kernel that does all its work in one
program shows up as one huge count.

Use only in an interpreter child process (the variable must be set before kernel modules import)::

    with program_work() as work:
        kernel_wrapper(...)
    work.programs, work.max_elements, work.total_elements
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class ProgramWork:
    elements: Counter = field(default_factory=Counter)  # grid index -> elements produced

    @property
    def programs(self) -> int:
        return len(self.elements)

    @property
    def max_elements(self) -> int:
        return max(self.elements.values(), default=0)

    @property
    def total_elements(self) -> int:
        return sum(self.elements.values())


def _size(out) -> int:
    data = getattr(out, "data", None)  # TensorHandle
    if data is None:
        handle = getattr(out, "handle", None)  # tl.tensor from a reduction
        data = getattr(handle, "data", None)
    return int(getattr(data, "size", 0) or 0)


@contextlib.contextmanager
def program_work():
    """Count, per program, the elements of every tensor the interpreter builds inside the block."""
    from triton.runtime import interpreter

    work = ProgramWork()
    builder = interpreter.interpreter_builder
    cls = interpreter.InterpreterBuilder
    patched = {}

    def wrap(original):
        def counted(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if getattr(self, "grid_idx", None) is not None:
                work.elements[self.grid_idx] += _size(out)
            return out

        return counted

    for name in dir(cls):
        if name.startswith("create_") and callable(getattr(cls, name)):
            patched[(cls, name)] = getattr(cls, name)
    reduce_cls = interpreter.ReduceScanOpInterface
    patched[(reduce_cls, "apply")] = reduce_cls.apply

    def counted_reduce(self, input):
        out = patched[(reduce_cls, "apply")](self, input)
        if getattr(builder, "grid_idx", None) is not None:
            work.elements[builder.grid_idx] += sum(_size(o) for o in (out if isinstance(out, tuple) else (out,)))
        return out

    for (owner, name), original in patched.items():
        setattr(owner, name, counted_reduce if owner is reduce_cls else wrap(original))
    builder.grid_idx = None
    try:
        yield work
    finally:
        for (owner, name), original in patched.items():
            setattr(owner, name, original)
