"""Which backend runs a model's operations: chosen once, at load, from its device, dtype and settings.

The interface (``Backend``) lives in ``kernels/backend.py``; the implementations in ``kernels/cpu/`` and
``kernels/triton/``. Keeping the choice here, apart from the interface, means no implementation imports the
module that imports it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kimitui.kernels.backend import REFERENCE, Backend
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings
from kimitui.kernels.triton.check import require_triton


def select_backend(device: torch.device | str, dtype: torch.dtype, settings: KernelSettings) -> Backend:
    """The backend for a model whose weights live on ``device`` in ``dtype``, chosen once.

    ``kernels=reference``: the reference. Device emulation: Triton on CPU tensors (interpreted).
    A CUDA/ROCm device: Triton (``TritonUnavailableError`` when it does not import or work). A CPU: the CPU backend (C++ kernels when they build and
    ``cpu_kernels`` allows). Anything else: the reference.
    """
    device = torch.device(device)
    if settings.kernels == "reference":
        return REFERENCE
    if settings.emulate_device and not settings.triton_interpret:
        raise ValueError("KIMITUI_EMULATE_DEVICE=1 needs TRITON_INTERPRET=1 (Triton kernels on CPU tensors)")
    # A GPU (or its emulation) without a working triton is an error naming the package, never a
    # silent fall back to the reference, which loops over experts with host syncs.
    if require_triton(device, settings):
        from kimitui.kernels.triton.backend import TritonBackend  # optional dependency: triton (checked just above)

        return TritonBackend()
    if device.type == "cpu":
        return CpuBackend(settings, dtype)
    return REFERENCE


def attach_backends(
    model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype, settings: KernelSettings
) -> Backend:
    """Choose the backend of a loaded model on ``device`` in ``dtype`` and hand it to every submodule
    with an ``ops`` attribute; submodules marked ``host_ram`` (experts offloaded to host RAM) get the
    CPU backend whatever the model's device, an emulated one included. Returns the model's backend."""
    device = torch.device(device)
    ops = select_backend(device, dtype, settings)
    on_cpu = device.type == "cpu" and not settings.emulate_device
    host_ops = ops if on_cpu else select_backend("cpu", dtype, replace(settings, emulate_device=False))
    if ops.name == "triton" and device.type == "cuda" and any(getattr(m, "needs_fla", False) for m in model.modules()):
        from kimitui.kernels.triton.kda_fla import require  # optional dependency: triton (the backend is Triton's)

        require()  # KDA layers on a GPU: fla-core or a clear error, never the PyTorch loops in silence
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), Backend):
            module.ops = host_ops if getattr(module, "host_ram", False) else ops
    return ops
