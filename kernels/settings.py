"""The kernel settings of a run, read once from the environment when a model is loaded.

Nothing in ``kernels`` reads the environment per call: ``select_backend`` takes one of these, so a
test or a tool picks a path by building the object it wants instead of flipping variables.

- ``KIMITUI_KERNELS=reference``: every operation runs the PyTorch reference (debugging, numerics
  comparisons). Unset, empty or ``auto``: the fastest backend for the device.
- ``KIMITUI_CPU_KERNELS=0`` (``false``, ``off``): no C++ CPU kernels; the CPU backend keeps its
  PyTorch paths.
- ``KIMITUI_CPU_W4A8`` (``auto``, ``0``, ``1``, or an int8 path: ``avx512vnni``, ``avxvnni``,
  ``scalar``): whether packed INT4 / MXFP4 experts on the CPU multiply int8-quantised activations
  (``kernels.cpu.quant_moe``); ``auto``: bf16 activations, where the CPU has an int8 dot-product
  instruction.
- ``KIMITUI_EMULATE_DEVICE=1``: a CPU run takes the branches a CUDA/ROCm run takes, Triton kernels
  interpreted on CPU tensors (needs ``TRITON_INTERPRET=1``, which Triton itself reads).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_KERNEL_CHOICES = ("auto", "reference")
_FALSE = ("0", "false", "off", "no")
_TRUE = ("1", "true", "on", "yes")
_W4A8_CHOICES = ("auto", *_FALSE, *_TRUE, "avx512vnni", "avxvnni", "scalar")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r}: expected one of 1/0, true/false, on/off")


@dataclass(frozen=True)
class KernelSettings:
    kernels: str = "auto"  # "auto": the device's fastest backend; "reference": the PyTorch oracle
    cpu_kernels: bool = True  # the C++ CPU extension may be built and used
    cpu_w4a8: str = "auto"  # KIMITUI_CPU_W4A8: W4A8 products for the CPU's packed experts
    emulate_device: bool = False  # CPU tensors take the device (Triton) path, interpreted
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels accept CPU tensors

    def __post_init__(self):
        if self.kernels not in _KERNEL_CHOICES:
            raise ValueError(f"KIMITUI_KERNELS={self.kernels!r}: expected one of {', '.join(_KERNEL_CHOICES)}")
        if self.cpu_w4a8 not in _W4A8_CHOICES:
            raise ValueError(f"KIMITUI_CPU_W4A8={self.cpu_w4a8!r}: expected one of {', '.join(_W4A8_CHOICES)}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KernelSettings:
        """The settings the environment ``env`` (default ``os.environ``) asks for."""
        env = os.environ if env is None else env
        return cls(
            kernels=env.get("KIMITUI_KERNELS", "").strip().lower() or "auto",
            cpu_kernels=_flag(env, "KIMITUI_CPU_KERNELS", True),
            cpu_w4a8=env.get("KIMITUI_CPU_W4A8", "").strip().lower() or "auto",
            emulate_device=_flag(env, "KIMITUI_EMULATE_DEVICE", False),
            triton_interpret=_flag(env, "TRITON_INTERPRET", False),
        )
