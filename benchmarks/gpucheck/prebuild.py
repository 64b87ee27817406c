"""The C++ CPU kernels, compiled before the section that times them.

The ``offload`` section runs host experts on the CPU kernels, which a fresh machine compiles on
first use (``kernels/cpu/build.py``: a minute or more). Inside that section's time limit the compile
would eat the measurement or get the section killed. So the build starts in a process of its own
when the one-shot starts, beside the GPU sections (which do not use those kernels), under a limit of
its own; the offload section waits for what is left of it and only then starts its clock. A build
that fails or overruns becomes a row, and the section then runs with ``KIMITUI_CPU_KERNELS=0`` (the
PyTorch path) rather than start the build again inside its limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpucheck.common import ERROR, FAIL, PASS, SKIP, Row

REPO = Path(__file__).resolve().parents[2]
CHECK = "C++ CPU kernels build (before the timed section)"
_CODE = """
from kimitui.kernels.cpu import few_rows as cpu_few_rows, quant_moe as cpu_quant_moe
print("BUILT", cpu_few_rows.available(), cpu_quant_moe.available())
"""


def kernels_disabled(env: dict[str, str]) -> bool:
    return env.get("KIMITUI_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off")


class Prebuild:
    """Builds (or finds cached) both C++ CPU extensions in a child process started now."""

    def __init__(
        self, env: dict[str, str], limit_s: float, log_path: Path, section: str = "offload", code: str = _CODE
    ):
        self.section, self.limit_s, self.log_path = section, limit_s, log_path
        self.started, self.wall_started = time.monotonic(), time.time()
        self.proc = None
        if kernels_disabled(env):
            return
        with open(log_path, "w") as log:
            # a session of its own: an overrun kills the compiler processes too, not only python
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def finish(self) -> tuple[Row, dict[str, str]]:
        """Wait for the build (at most what is left of its limit) -> its row, and the environment
        changes the timed section then needs."""
        if self.proc is None:
            return Row(self.section, CHECK, SKIP, note="KIMITUI_CPU_KERNELS=0: nothing to build"), {}
        left = self.limit_s - (time.monotonic() - self.started)
        try:
            rc = self.proc.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            removed = remove_stale_locks(self.wall_started)
            return Row(
                self.section,
                CHECK,
                ERROR,
                ms=(time.monotonic() - self.started) * 1e3,
                note=f"not finished within its {self.limit_s:.0f} s limit (killed"
                f"{', its build lock removed' if removed else ''}): the section runs the "
                "PyTorch path (KIMITUI_CPU_KERNELS=0)",
            ), {"KIMITUI_CPU_KERNELS": "0"}
        ms = (time.monotonic() - self.started) * 1e3
        output = self.log_path.read_text(errors="replace")
        built = next((ln.split()[1:] for ln in output.splitlines() if ln.startswith("BUILT ")), None)
        if rc == 0 and built == ["True", "True"]:
            return Row(self.section, CHECK, PASS, ms=ms, note="built or found in the cache"), {}
        last = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("BUILT ")][-1:] or [""]
        what = f"exit code {rc}" if rc else f"built (few-rows, quantised MoE): {built}"
        return (
            Row(
                self.section,
                CHECK,
                FAIL,
                ms=ms,
                note=f"{what}; {last[0][:200]} - the section runs the PyTorch path (KIMITUI_CPU_KERNELS=0)",
            ),
            {"KIMITUI_CPU_KERNELS": "0"},
        )


def remove_stale_locks(since: float) -> int:
    """Remove the lock files of kimitui's extension builds created after ``since`` (wall clock): a
    killed build leaves torch's lock behind, and every later load of that extension would wait on it
    for ever. -> how many were removed."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = 0
    for lock in root.glob("**/kimitui_cpu_*/lock"):
        try:
            if lock.stat().st_mtime >= since - 1:
                lock.unlink()
                removed += 1
        except OSError:  # gone meanwhile
            pass
    return removed
