"""Failure, not silence, through the path a model takes: ``select_backend`` for a CUDA/ROCm device
with a missing or broken ``triton`` raises TritonUnavailableError naming the package (never a quiet
fall back to the PyTorch references), unless ``KIMITUI_KERNELS=reference`` asks for them.

tests/kernels/triton/test_triton_check.py covers ``require_triton`` with fake package names; here the real
name ``triton`` is made missing (``sys.modules["triton"] = None``, what importlib reports for an
absent module) or broken (a ``triton`` package first on the path whose import raises, as a wheel
built for another CUDA does) in a child process, so the pytest process's own triton is untouched.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import sys
if sys.argv[1] == "missing":
    sys.modules["triton"] = None
import torch
from kimitui.kernels.backend import REFERENCE
from kimitui.kernels.select import select_backend
from kimitui.kernels.settings import KernelSettings
from kimitui.kernels.triton.check import TritonUnavailableError

assert select_backend("cuda", torch.bfloat16, KernelSettings(kernels="reference")) is REFERENCE
assert type(select_backend("cpu", torch.float32, KernelSettings(cpu_kernels=False))).__name__ == "CpuBackend"
try:
    ops = select_backend("cuda", torch.bfloat16, KernelSettings.from_env({}))
except TritonUnavailableError as e:
    print("RAISED", e)
else:
    print("SELECTED", type(ops).__name__)
"""


@pytest.mark.parametrize(
    "how, reason", [("missing", "it is not installed"), ("broken", "importing it failed (OSError: libcuda.so.1")]
)
def test_gpu_backend_without_triton_is_an_error_naming_it(tmp_path, how, reason):
    fake = tmp_path / "fake"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")
    path = [str(fake)] if how == "broken" else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [str(REPO)]))
    env.pop("KIMITUI_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, how], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("RAISED the cuda device needs the 'triton' package"), out
    assert reason in out and "KIMITUI_KERNELS=reference" in out


class _KDALike(torch.nn.Module):
    """What attach_backends looks at in a model with Kimi Delta Attention layers."""

    needs_fla = True

    def __init__(self):
        super().__init__()
        from kimitui.kernels.backend import REFERENCE

        self.ops = REFERENCE


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kda_model_on_a_gpu_without_fla_core_is_an_error_naming_it(monkeypatch):
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.select import attach_backends
    from kimitui.kernels.settings import KernelSettings
    from kimitui.kernels.triton import kda_fla

    monkeypatch.setitem(sys.modules, "fla", None)  # what importlib reports for an absent package
    kda_fla.unavailable_reason.cache_clear()
    try:
        model = torch.nn.Sequential(_KDALike())
        with pytest.raises(
            RuntimeError, match=r"needs fla-core>=0.6 \(fla-core is not installed\).*KIMITUI_KERNELS=reference"
        ):
            attach_backends(model, "cuda", torch.bfloat16, KernelSettings())
        assert attach_backends(model, "cuda", torch.bfloat16, KernelSettings(kernels="reference")) is REFERENCE
        # the CPU and the emulated device path keep kernels/kda.py: no fla-core needed there
        attach_backends(model, "cpu", torch.float32, KernelSettings(cpu_kernels=False))
    finally:
        kda_fla.unavailable_reason.cache_clear()
