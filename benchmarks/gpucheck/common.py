"""What every section of the GPU one-shot shares: its rows, its clock, its error measure, its deadline.

A section runs in its own process (``python -m benchmarks.gpucheck.section NAME``) and appends one
JSON line per row to a file as soon as the row is measured (a check that measures several shapes
yields its rows one by one), so a section that crashes or is killed at its time limit keeps the
rows it finished, those of a check it was killed in included. ``Mode`` holds what differs between a real GPU run and the CPU self-test
(``--emulate``: ``KIMITUI_EMULATE_DEVICE=1 TRITON_INTERPRET=1``, tiny shapes): the device, the
dtype and whether shapes are Kimi's or toy ones; the checks themselves are the same code.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
import types
from dataclasses import asdict, dataclass, field

import torch

PASS, FAIL, SKIP, ERROR = "pass", "FAIL", "skip", "ERROR"


@dataclass
class Row:
    section: str
    check: str
    status: str  # PASS / FAIL / SKIP / ERROR
    err: float | None = None  # max |got - want| / max |want|
    ms: float | None = None  # the kernel's (or step's) best time
    ref_ms: float | None = None  # the PyTorch reference's best time
    gbps: float | None = None  # bytes the kernel must move / its time
    tok_s: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Mode:
    emulate: bool  # CPU self-test: interpreted Triton, tiny shapes
    device: torch.device = field(default=torch.device("cpu"))
    dtype: torch.dtype = torch.bfloat16

    @staticmethod
    def from_env() -> "Mode":
        """The mode a section process runs in, as the parent set its environment."""
        emulate = os.environ.get("KIMITUI_EMULATE_DEVICE", "") == "1"
        if emulate:
            # The interpreter's fp32 -> bf16 cast truncates instead of rounding: fp16 checks the same
            # code paths with errors the tolerances can hold.
            return Mode(True, torch.device("cpu"), torch.float16)
        return Mode(False, torch.device("cuda", 0), torch.bfloat16)

    def pick(self, real, tiny):
        """Kimi's size on a GPU, the toy size in the self-test."""
        return tiny if self.emulate else real

    @property
    def tolerance(self) -> float:
        """Largest max-relative error a check passes with: a few ulps of bf16 (2^-8) or fp16
        accumulated over a reduction, as tests/kernels/test_kernels_gpu.py allows."""
        return 2e-2


class Deadline:
    """A section's time limit, checked between checks (a running kernel cannot be interrupted in
    process: the parent kills the whole section process if it overruns)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Sink:
    """Appends rows as JSON lines to ``path`` (and prints them), flushing each."""

    def __init__(self, path: str, section: str, deadline: Deadline):
        self.path, self.section, self.deadline = path, section, deadline

    def add(self, row: Row) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")
        print(format_row(row), flush=True)

    def run(self, name: str, check, *args, min_left: float = 5.0) -> None:
        """Run ``check(*args)`` unless the section's time is nearly spent. ``check`` returns a Row or
        a list of them, or yields its rows one at a time: each is written the moment it is yielded,
        and between two the deadline is checked again. An exception becomes an ERROR row naming it
        (after the rows already yielded), and the section goes on."""
        if self.deadline.left() < min_left:
            self.add(Row(self.section, name, SKIP, note="section time limit reached"))
            return
        try:
            out = check(*args)
            if isinstance(out, types.GeneratorType):
                for row in out:
                    self.add(row)
                    if self.deadline.left() < min_left:
                        out.close()
                        self.add(Row(self.section, f"{name}: the rest", SKIP, note="section time limit reached"))
                        return
                return
        except Exception as e:  # one failed check must not lose the section's other rows
            tb = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{os.path.basename(tb.filename)}:{tb.lineno}"
            self.add(Row(self.section, name, ERROR, note=f"{type(e).__name__}: {_one_line(e)} ({where})"))
            return
        for row in out if isinstance(out, list) else [out]:
            self.add(row)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def format_row(r: Row) -> str:
    status, err, ms, ref_ms, gbps, tok_s, note = cells(r)
    return (
        f"[{r.section}] {r.check}: {status}  err {err}  time {ms}  ref {ref_ms}  GB/s {gbps}  tok/s {tok_s}  {note}"
    ).rstrip()


def cells(r: Row) -> list[str]:
    """The table cells of a row after its check name: status, err, time, ref, GB/s, tok/s, note."""
    return [
        r.status,
        fmt(r.err, ".1e"),
        fmt_ms(r.ms),
        fmt_ms(r.ref_ms),
        fmt(r.gbps, ".0f"),
        fmt(r.tok_s, ".1f"),
        r.note,
    ]


def fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def fmt_ms(ms) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_ms(fn, device: torch.device, repeats: int = 10, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in milliseconds, the device synchronised around each call (the
    best of several: the quantity is what the code can do, not what the machine's noise added)."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| in fp32 (nan when either holds a nan or inf)."""
    got, want = got.float(), want.float()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("nan")
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-12)).item()


def status_for(err: float, tol: float) -> str:
    return PASS if err == err and err <= tol else FAIL  # nan fails
